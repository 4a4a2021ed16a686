//! The Prometheus recorder behind `GET /metrics`: installed once per process as the `metrics`
//! crate's global recorder, so the service's counters and (once newcache's `metrics` feature is
//! on) the library's reach the same text.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The process's Prometheus handle, installing the recorder on first use. If another recorder
/// was installed first (by the embedding program), a private one is used: `/metrics` is still
/// valid Prometheus text, without what goes through the global facade.
pub(crate) fn prometheus() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .install_recorder()
                .unwrap_or_else(|e| {
                    eprintln!("webapp: a metrics recorder is already installed ({e}); /metrics shows only its own");
                    PrometheusBuilder::new().build_recorder().handle()
                })
        })
        .clone()
}
