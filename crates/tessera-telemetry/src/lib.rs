//! Gated attention-sink and outlier telemetry summaries (SPEC §6).
