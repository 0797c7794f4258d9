package worker

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/task"
)

// startConsumerSpan continues the trace the relay wrote into the message
// headers with a CONSUMER span; the claim, the handler's progress (as span
// events) and the outcome's writes hang under it. The attributes are built
// only for a span that records: most are not sampled, and building them
// was a tenth of the worker's CPU.
func (w *Worker) startConsumerSpan(ctx context.Context, d outbox.Delivery) (context.Context, trace.Span) {
	parent := w.propagator.Extract(ctx, propagation.MapCarrier(d.Headers))
	ctx, span := w.tracer.Start(parent, "process "+d.Queue, trace.WithSpanKind(trace.SpanKindConsumer))
	if span.IsRecording() {
		span.SetAttributes(
			semconv.MessagingSystemRabbitmq,
			semconv.MessagingOperationTypeDeliver,
			semconv.MessagingDestinationName(d.Exchange),
			semconv.MessagingRabbitmqDestinationRoutingKey(d.Body.Type),
			semconv.MessagingMessageID(d.MessageID),
			attribute.String("messaging.rabbitmq.queue", d.Queue),
			attribute.Bool("messaging.rabbitmq.redelivered", d.Redelivered),
			attribute.String("conveyor.task_id", d.Body.TaskID.String()),
			attribute.String("conveyor.task_type", d.Body.Type),
			// The attempt the delivery's claim starts: the message
			// carries the count before it.
			attribute.Int("conveyor.attempt", d.Body.Attempt+1),
		)
	}
	return ctx, span
}

// nameOrg says in a CONSUMER span whose task it claimed: the message does
// not name the task's org.
func nameOrg(span trace.Span, t *task.Task) {
	if span.IsRecording() {
		span.SetAttributes(attribute.String("conveyor.org_id", t.OrgID.String()))
	}
}

// untraced is ctx without its span, for writes that must leave no span in
// the task's trace (the database pool traces a statement only under a span
// that records).
func untraced(ctx context.Context) context.Context {
	return trace.ContextWithSpanContext(ctx, trace.SpanContext{})
}

// inject returns the W3C headers of ctx's span, for an outbox row.
func (w *Worker) inject(ctx context.Context) task.Carrier {
	c := task.Carrier{}
	w.propagator.Inject(ctx, propagation.MapCarrier(c))
	return c
}

// retryTrace starts the trace of a task's next attempt: a new root linked
// to the failed attempt's span, so each attempt is its own trace and Jaeger
// leads from one to the other. It returns the new trace's context, which
// becomes the task's trace and travels with its message.
func (w *Worker) retryTrace(ctx context.Context, t task.Task) task.Carrier {
	rctx, span := w.tracer.Start(ctx, "schedule retry",
		trace.WithNewRoot(),
		trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithLinks(trace.LinkFromContext(ctx, attribute.String("conveyor.link", "previous attempt"))),
		trace.WithAttributes(
			attribute.String("conveyor.task_id", t.ID.String()),
			attribute.String("conveyor.task_type", t.Type),
			attribute.String("conveyor.org_id", t.OrgID.String()),
			attribute.Int("conveyor.next_attempt", t.Attempt+1),
		))
	defer span.End()
	return w.inject(rctx)
}
