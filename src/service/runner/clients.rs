//! How the pipeline's producers are configured: idempotent, the changelog's
//! gapless, and how long each kind of record lingers to be batched.

use rdkafka::error::KafkaError;
use rdkafka::producer::BaseProducer;

use crate::service::kafka::{client_config, ClientRole, DeliveryReports};

/// How long the changelog's records wait to be batched (see `run_pipeline`).
pub(super) const CHANGELOG_LINGER_MS: &str = "1";
/// How long outputs wait to be batched in mode none, and where markers wait
/// for them (see `run_pipeline`).
pub(super) const OUTPUT_LINGER_MS: &str = "5";
pub(super) const OUTPUT_LINGER_MS_MARKERS_WAIT: &str = "1";

/// The changelog's producer is gapless: a record lands only if every record
/// before it in the partition landed. A marker goes out right behind its
/// backup's entries and recovery trusts that a marker in the log has them all
/// before it. librdkafka's gapless guarantee turns any failure that could
/// leave a gap into a fatal error; a record that times out is the one gap it
/// allows, so records never time out (during an outage input waits on the
/// window instead). Set after the user's properties: recovery depends on them.
pub(super) const GAPLESS_CHANGELOG: &[(&str, &str)] =
    &[("enable.gapless.guarantee", "true"), ("message.timeout.ms", "0")];

/// An idempotent producer whose delivery reports carry a packed [`Delivery`],
/// with `fixed` properties over the user's.
pub(super) fn idempotent_producer(
    kafka: &crate::service::config::KafkaConfig,
    linger_ms: &str,
    fixed: &[(&str, &str)],
) -> Result<BaseProducer<DeliveryReports>, KafkaError> {
    let mut config = client_config(
        kafka,
        ClientRole::Producer,
        &[
            ("enable.idempotence", "true"),
            ("linger.ms", linger_ms),
            ("compression.type", "lz4"),
        ],
    );
    for (key, value) in fixed {
        config.set(*key, *value);
    }
    config.create_with_context(DeliveryReports::default())
}
