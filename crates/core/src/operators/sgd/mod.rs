//! Distributed online learning: logistic regression trained by several workers
//! whose models a global task averages and feeds back (the extended AF-Stream
//! paper's distributed SGD).
//!
//! Each input partition has a [`SgdWorker`]: it trains on its items like
//! [`OnlineLogisticRegression`](super::OnlineLogisticRegression) and, every
//! `publish_every` items, ends an iteration by publishing a [`LocalModel`]. The
//! [`ModelAverager`] keeps the latest model of every worker and publishes their
//! average as a [`GlobalModel`], which every worker takes in
//! ([`SgdWorker::adopt`]). How far a worker may run ahead of the slowest one is
//! the consistency model:
//!
//! * ASP: never waits; the global model is taken in whenever it arrives;
//! * BSP: after publishing iteration i, waits for the global model of iteration
//!   i (the average of every worker's i-th model);
//! * SSP: runs at most `staleness` iterations ahead of the slowest worker.
//!
//! A waiting worker says so through [`Operator::ready`](crate::Operator::ready);
//! the task driver then takes no input until the adapter hands it the global
//! model ([`TaskDriver::side_input`](crate::TaskDriver::side_input)).

mod averager;
mod worker;

use serde::{Deserialize, Serialize};

use super::LogisticConfig;
use crate::error::CoreError;

pub use averager::ModelAverager;
pub use worker::SgdWorker;

/// How far a worker may run ahead of the slowest worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// Asynchronous: never wait for the global model.
    Asp,
    /// Bulk synchronous: wait at every iteration for the global model of it.
    Bsp,
    /// Stale synchronous: at most `staleness` iterations ahead of the slowest.
    Ssp,
}

/// The configuration both sides of a distributed learner share.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistributedSgdConfig {
    /// log2 of the number of hashed weights.
    pub feature_bits: u32,
    /// η0 of η_t = η0/√t.
    pub learning_rate: f64,
    /// R: inputs longer than this are scaled down to it.
    pub max_feature_norm: f64,
    /// How many workers (input partitions) the averager waits for.
    pub workers: u32,
    /// Items a worker trains on per iteration, before publishing its model.
    pub publish_every: u64,
    pub consistency: Consistency,
    /// SSP: how many iterations a worker may run ahead of the slowest.
    pub staleness: u64,
}

impl Default for DistributedSgdConfig {
    fn default() -> Self {
        let model = LogisticConfig::default();
        DistributedSgdConfig {
            feature_bits: 12,
            learning_rate: model.learning_rate,
            max_feature_norm: model.max_feature_norm,
            workers: 1,
            publish_every: 1_000,
            consistency: Consistency::Asp,
            staleness: 3,
        }
    }
}

impl DistributedSgdConfig {
    /// The model every worker trains.
    pub fn model(&self) -> LogisticConfig {
        LogisticConfig {
            feature_bits: self.feature_bits,
            learning_rate: self.learning_rate,
            max_feature_norm: self.max_feature_norm,
        }
    }

    /// How many iterations a worker may be ahead of the global model's clock.
    pub fn allowed_lead(&self) -> u64 {
        match self.consistency {
            Consistency::Asp => u64::MAX,
            Consistency::Bsp => 0,
            Consistency::Ssp => self.staleness,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), CoreError> {
        if self.workers == 0 {
            return Err(CoreError::parameter("workers", self.workers, "at least 1"));
        }
        if self.publish_every == 0 {
            return Err(CoreError::parameter("publish_every", self.publish_every, "at least 1"));
        }
        Ok(())
    }
}

/// A worker's model at the end of one of its iterations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalModel {
    pub worker: u32,
    pub iteration: u64,
    /// Items the worker has trained on in all.
    pub items: u64,
    /// Mean progressive log-loss of the iteration's items (each predicted
    /// before training on it).
    pub loss: f64,
    /// Fraction of the iteration's items predicted right.
    pub accuracy: f64,
    /// The weights that are not zero, as (slot, weight).
    pub weights: Vec<(u32, f64)>,
}

/// The average of the workers' latest models.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GlobalModel {
    /// The iteration every worker has reached: the slowest worker's.
    pub clock: u64,
    /// Worker models averaged so far, in all.
    pub version: u64,
    /// Workers whose models are in the average.
    pub workers: u32,
    /// Items the averaged workers have trained on in all.
    pub items: u64,
    /// Mean of the workers' latest iteration losses.
    pub loss: f64,
    /// Mean of the workers' latest iteration accuracies.
    pub accuracy: f64,
    /// The L1 norm of the averaged weights.
    pub weights_l1: f64,
    /// The averaged weights that are not zero, as (slot, weight).
    pub weights: Vec<(u32, f64)>,
    /// Worker k's iteration whose model is in the average, at index k (0: none
    /// yet). Empty when not known (a model from before this field): a worker
    /// then takes the model in as it is.
    #[serde(default)]
    pub iterations: Vec<u64>,
}
