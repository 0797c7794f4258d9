package relay

import (
	"context"
	"strconv"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// startProducerSpan continues the trace carried by the outbox row with a
// PRODUCER span and returns the headers to publish, which now carry that
// span's context to the consumer.
func (r *Relay) startProducerSpan(ctx context.Context, pub Publisher, m outbox.Message) (map[string]string, trace.Span) {
	parent := r.propagator.Extract(ctx, propagation.MapCarrier(m.Headers))
	exchange, routingKey := pub.Route(m)
	_, span := r.tracer.Start(parent, "publish "+exchange,
		trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(
			semconv.MessagingSystemRabbitmq,
			semconv.MessagingOperationTypePublish,
			semconv.MessagingDestinationName(exchange),
			semconv.MessagingRabbitmqDestinationRoutingKey(routingKey),
			semconv.MessagingMessageID(strconv.FormatInt(m.ID, 10)),
			attribute.String("conveyor.task_id", m.TaskID.String()),
			attribute.String("conveyor.message_kind", string(m.Kind)),
			attribute.Int("conveyor.outbox_attempts", m.Attempts),
		))
	if span.IsRecording() {
		// Built only for a span that records: most are not sampled.
		span.SetAttributes(attribute.String("conveyor.task_type", m.TaskType),
			attribute.String("conveyor.org_id", m.OrgID.String()))
	}
	headers := make(map[string]string, len(m.Headers)+2)
	for k, v := range m.Headers {
		headers[k] = v
	}
	r.propagator.Inject(trace.ContextWithSpan(ctx, span), propagation.MapCarrier(headers))
	return headers, span
}

// nameEnvelope says in a task's PRODUCER span which message carried it,
// once the publisher packed it with others: the packed exchange and the
// packed message's id, as the consumer's span of the task says.
func nameEnvelope(span trace.Span, env outbox.Envelope) {
	span.SetName("publish " + env.Exchange)
	span.SetAttributes(semconv.MessagingDestinationName(env.Exchange), semconv.MessagingMessageID(env.MessageID))
}

func endFailed(span trace.Span, reason string) {
	span.SetStatus(codes.Error, reason)
	span.End()
}

// endParked ends the span of a message no queue took: it waits in the
// outbox for a worker of its type, the normal course for a type whose
// workers have not started, and no error of the task's.
func endParked(span trace.Span, reason string) {
	span.AddEvent("parked", trace.WithAttributes(attribute.String("conveyor.reason", reason)))
	span.End()
}
