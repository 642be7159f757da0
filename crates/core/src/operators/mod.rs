//! The built-in operators, one per module, each built from the core's structures.

pub mod grep;
pub mod heavy_hitters;
pub mod keyed_aggregation;
pub mod logistic_regression;
pub mod online_join;
pub mod sgd;
pub mod tokenize;
pub mod word_count;

pub use grep::Grep;
pub use heavy_hitters::{FlowPacket, HeavyHitter, HeavyHitterConfig, HeavyHitters, HitterThreshold};
pub use keyed_aggregation::{Aggregate, KeyUpdate, KeyedAggregation, KeyedAggregationConfig, KeyedValue};
pub use logistic_regression::{LabeledVector, LogisticConfig, OnlineLogisticRegression, Prediction};
pub use online_join::{JoinConfig, JoinEstimate, JoinTuple, OnlineJoin, Side};
pub use sgd::{Consistency, DistributedSgdConfig, GlobalModel, LocalModel, ModelAverager, SgdWorker};
pub use tokenize::{Tokenize, TokenizeConfig};
pub use word_count::{WordCount, WordCountConfig};
