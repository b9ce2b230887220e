//! W3C trace context across the service: the `traceparent` of a request joins its span to the
//! caller's trace (with the `otel` feature), an advance's event carries it on, and applying an
//! event that carries one runs in a span of that trace (docs/protocol.md, "Trace context").

use tidemark_core::store::{HandleError, Handler};
use tidemark_core::Envelope;

/// The OpenTelemetry context of a remote parent, from a valid `traceparent`.
#[cfg(feature = "otel")]
fn remote_context(traceparent: &str) -> Option<opentelemetry::Context> {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
    let (trace_id, parent_id) = tidemark_core::envelope::parse_traceparent(traceparent)?;
    let flags = u8::from_str_radix(traceparent.get(53..55)?, 16).ok()?;
    let span_context = SpanContext::new(
        TraceId::from_hex(trace_id).ok()?,
        SpanId::from_hex(parent_id).ok()?,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    Some(opentelemetry::Context::new().with_remote_span_context(span_context))
}

/// Make `span` a child of the trace `traceparent` names (a no-op without the `otel` feature,
/// or for a malformed value).
pub fn join(span: &tracing::Span, traceparent: Option<&str>) {
    #[cfg(feature = "otel")]
    if let Some(context) = traceparent.and_then(remote_context) {
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let _ = span.set_parent(context);
    }
    #[cfg(not(feature = "otel"))]
    let _ = (span, traceparent);
}

/// The `traceparent` of the current span (its OpenTelemetry trace and span ids), with the
/// `otel` feature and a span being exported; `None` otherwise.
pub fn current() -> Option<String> {
    #[cfg(feature = "otel")]
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let context = tracing::Span::current().context();
        let span = context.span();
        let span_context = span.span_context();
        if span_context.is_valid() {
            return Some(format!(
                "00-{}-{}-{:02x}",
                span_context.trace_id(),
                span_context.span_id(),
                span_context.trace_flags().to_u8()
            ));
        }
    }
    None
}

/// A handler that applies each event carrying a trace context inside an `apply` span of that
/// trace; events without one are applied as they are (no span).
pub struct Traced<'a, T: ?Sized>(pub &'a mut (dyn Handler<T> + Send));

impl<T: ?Sized> Handler<T> for Traced<'_, T> {
    fn handle(&mut self, target: &T, consumer_id: &str, event: &Envelope) -> Result<(), HandleError> {
        let Some(traceparent) = event.traceparent.as_deref() else {
            return self.0.handle(target, consumer_id, event);
        };
        let span = tracing::info_span!(
            "apply",
            consumer = consumer_id,
            flow = %event.flow_id,
            seq = event.seq,
            event_type = %event.event_type,
            traceparent,
        );
        join(&span, Some(traceparent));
        let _entered = span.enter();
        self.0.handle(target, consumer_id, event)
    }

    fn refuses_before_writing(&self) -> bool {
        self.0.refuses_before_writing()
    }

    fn batch_max(&self) -> usize {
        self.0.batch_max()
    }

    /// A batch runs in one `apply_batch` span, joined to the trace of its first event that
    /// carries one (a span has one parent; the events' other traces are not linked).
    fn handle_batch(&mut self, target: &T, consumer_id: &str, events: &[Envelope]) -> Result<(), HandleError> {
        let traceparent = events.iter().find_map(|e| e.traceparent.as_deref());
        let span = tracing::info_span!("apply_batch", consumer = consumer_id, events = events.len());
        join(&span, traceparent);
        let _entered = span.enter();
        self.0.handle_batch(target, consumer_id, events)
    }
}
