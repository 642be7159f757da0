//! Asking the brokers again while they do not answer: at start-up, while a
//! cluster may still be coming up, and for the requests a restore depends
//! on, which a busy broker can leave unanswered past their timeout. Only a
//! request that got no answer is asked again; a refusal fails the same way
//! every time and is returned at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::KafkaSetupError;
use crate::service::config::KafkaConfig;

/// Whether a setup request failed only because the brokers could not be
/// reached or were not ready (down, unresolvable, timing out, electing a
/// leader): asking again later may succeed. A refusal (a bad property, a
/// missing or invalid topic, no authorisation) fails the same way every time.
pub fn is_unreachable(error: &KafkaSetupError) -> bool {
    let KafkaSetupError::Kafka(error) = error else {
        return false;
    };
    is_transient(error)
}

/// Whether a request failed for want of an answer (a timeout, no broker, no
/// leader yet), not because the brokers refused it.
fn is_transient(error: &KafkaError) -> bool {
    matches!(
        error.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::OperationTimedOut
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::Resolve
                | RDKafkaErrorCode::NetworkException
                | RDKafkaErrorCode::BrokerNotAvailable
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::NotController
                | RDKafkaErrorCode::CoordinatorNotAvailable
                | RDKafkaErrorCode::CoordinatorLoadInProgress
        )
    )
}

/// Calls `step` until it answers, fails with an error `transient` does not
/// accept, `patience` has passed or `stop` is set, backing off from 250 ms
/// to 5 s; `retrying` is told each error asked again after and the time
/// left. Returns the last error.
fn retried<T, E>(
    patience: Duration,
    stop: &AtomicBool,
    transient: impl Fn(&E) -> bool,
    mut retrying: impl FnMut(&E, Duration),
    mut step: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(250);
    loop {
        let error = match step() {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        let left = patience.saturating_sub(started.elapsed());
        if !transient(&error) || left.is_zero() || stop.load(Ordering::SeqCst) {
            return Err(error);
        }
        retrying(&error, left);
        let until = Instant::now() + backoff.min(left);
        while Instant::now() < until && !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(50));
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Runs a setup step, asking again (backing off from 250 ms to 5 s) while it
/// fails with [`is_unreachable`], for up to `kafka.startup_timeout_ms` or
/// until `stop` is set; each retry is logged with the error. Any other error
/// is returned; the last unreachable one comes back as
/// [`KafkaSetupError::Unreachable`], naming the brokers and the wait.
pub fn patiently<T>(
    kafka: &KafkaConfig,
    stop: &AtomicBool,
    what: &str,
    step: impl FnMut() -> Result<T, KafkaSetupError>,
) -> Result<T, KafkaSetupError> {
    let started = Instant::now();
    let patience = Duration::from_millis(kafka.startup_timeout_ms);
    let log = |error: &KafkaSetupError, left: Duration| {
        tracing::warn!(
            "{what}: the brokers ({}) cannot be reached ({error}); trying again for up to {} s more \
             (kafka.startup_timeout_ms)",
            kafka.bootstrap_servers,
            left.as_secs()
        )
    };
    retried(patience, stop, is_unreachable, log, step).map_err(|error| {
        if !is_unreachable(&error) {
            return error;
        }
        KafkaSetupError::Unreachable {
            what: what.to_string(),
            servers: kafka.bootstrap_servers.clone(),
            waited_ms: started.elapsed().as_millis(),
            patience_ms: kafka.startup_timeout_ms,
            source: Box::new(error),
        }
    })
}

/// Sends `request` again while it fails with [`is_transient`], backing off
/// from 250 ms to 5 s, until `patience` has passed; each retry is logged.
/// A broker busy with other work can leave one request unanswered past its
/// timeout (the project's broker did, for a new changelog's metadata, while
/// it stored a large input), and a restore that gave up on it would fail
/// the task's start.
pub(super) fn asked_again<T>(
    what: &str,
    patience: Duration,
    request: impl FnMut() -> Result<T, KafkaError>,
) -> Result<T, KafkaError> {
    let log = |error: &KafkaError, left: Duration| tracing::warn!(%error, "{what}: no answer; asking again for up to {} s more", left.as_secs());
    retried(patience, &AtomicBool::new(false), is_transient, log, request)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unreachable() -> KafkaSetupError {
        KafkaSetupError::Kafka(KafkaError::MetadataFetch(RDKafkaErrorCode::BrokerTransportFailure))
    }

    /// A request that fails with `error` twice, then answers 7; counts its
    /// calls in `attempts`.
    fn answers_the_third_time<'a, E>(
        attempts: &'a mut u32,
        error: impl Fn() -> E + 'a,
    ) -> impl FnMut() -> Result<u32, E> + 'a {
        move || {
            *attempts += 1;
            if *attempts < 3 {
                Err(error())
            } else {
                Ok(7)
            }
        }
    }

    #[test]
    fn a_request_that_times_out_is_asked_again_until_patience_runs_out() {
        let timed_out = || KafkaError::MetadataFetch(RDKafkaErrorCode::OperationTimedOut);
        let mut attempts = 0;
        let answer = asked_again(
            "a request",
            Duration::from_secs(60),
            answers_the_third_time(&mut attempts, timed_out),
        );
        assert_eq!(answer.ok(), Some(7));
        assert_eq!(attempts, 3);

        // A refusal is not asked again.
        let mut attempts = 0;
        let refused = asked_again("a request", Duration::from_secs(60), || -> Result<(), _> {
            attempts += 1;
            Err(KafkaError::MetadataFetch(RDKafkaErrorCode::UnknownTopicOrPartition))
        });
        assert!(refused.is_err());
        assert_eq!(attempts, 1);

        // Out of patience: the last error comes back.
        let started = Instant::now();
        let mut attempts = 0;
        let error = asked_again("a request", Duration::from_millis(600), || -> Result<(), _> {
            attempts += 1;
            Err(timed_out())
        })
        .expect_err("never answered");
        assert_eq!(error.rdkafka_error_code(), Some(RDKafkaErrorCode::OperationTimedOut));
        assert!(attempts >= 2, "asked again before giving up: {attempts}");
        assert!(started.elapsed() < Duration::from_secs(5), "gave up near its patience");
    }

    #[test]
    fn setup_steps_are_asked_again_while_the_brokers_cannot_be_reached() {
        let kafka = KafkaConfig::new("broker:9092");
        let stop = AtomicBool::new(false);
        let mut attempts = 0;
        let answer = patiently(
            &kafka,
            &stop,
            "a step",
            answers_the_third_time(&mut attempts, unreachable),
        );
        assert_eq!(answer.ok(), Some(7));
        assert_eq!(attempts, 3);

        // A refusal is not asked again.
        let mut attempts = 0;
        let refused = patiently(&kafka, &stop, "a step", || -> Result<(), _> {
            attempts += 1;
            Err(KafkaSetupError::MissingTopic("in".into()))
        });
        assert!(matches!(refused, Err(KafkaSetupError::MissingTopic(_))));
        assert_eq!(attempts, 1);

        // Out of patience: the error names the brokers and the setting.
        let impatient = KafkaConfig {
            startup_timeout_ms: 0,
            ..KafkaConfig::new("broker:9092")
        };
        let error = patiently(&impatient, &stop, "reading metadata", || -> Result<(), _> {
            Err(unreachable())
        })
        .expect_err("no broker");
        let text = error.to_string();
        assert!(
            text.contains("reading metadata") && text.contains("broker:9092") && text.contains("startup_timeout_ms"),
            "{text}"
        );
        assert!(!is_unreachable(&error), "given up: not asked again by a caller");
    }
}
