package telemetry

import (
	"context"
	"errors"
	"fmt"

	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"
)

// Version is the build's version, set with -ldflags at build time.
var Version = "dev"

// TraceConfig says how to trace.
type TraceConfig struct {
	// ServiceName is used unless OTEL_SERVICE_NAME overrides it.
	ServiceName string
	// Export turns the exporter on; it then reads the standard OTEL_*
	// variables (endpoint, protocol, headers).
	Export bool
}

// SetupTracing installs a tracer provider and the W3C propagators as the
// process globals, and returns the provider and its shutdown function. With
// Export off, spans are still created (trace ids reach logs and the task
// JSON, context propagates) but nothing leaves the process.
func SetupTracing(ctx context.Context, cfg TraceConfig) (trace.TracerProvider, func(context.Context) error, error) {
	res, err := resource.Merge(resource.Default(), resource.NewSchemaless(
		semconv.ServiceName(cfg.ServiceName),
		semconv.ServiceVersion(Version),
	))
	if err != nil && !errors.Is(err, resource.ErrSchemaURLConflict) {
		return nil, nil, fmt.Errorf("telemetry resource: %w", err)
	}
	// resource.Default reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES;
	// let them win over the built-in name.
	if res, err = resource.Merge(res, resource.Environment()); err != nil && !errors.Is(err, resource.ErrSchemaURLConflict) {
		return nil, nil, fmt.Errorf("telemetry resource: %w", err)
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithResource(res)}
	if !cfg.Export {
		// Nothing to export to: spans are not recorded, which makes them
		// almost free, yet they still get ids that propagate and reach the
		// task JSON and the logs. (Otherwise the SDK honours
		// OTEL_TRACES_SAMPLER.)
		opts = append(opts, sdktrace.WithSampler(sdktrace.NeverSample()))
	}
	if cfg.Export {
		exp, err := autoexport.NewSpanExporter(ctx)
		if err != nil {
			return nil, nil, fmt.Errorf("trace exporter: %w", err)
		}
		opts = append(opts, sdktrace.WithBatcher(exp))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	otel.SetTracerProvider(tp)
	// W3C trace context only: baggage is not carried between processes
	// (a caller's baggage would otherwise ride every message and log).
	otel.SetTextMapPropagator(propagation.TraceContext{})
	return tp, tp.Shutdown, nil
}
