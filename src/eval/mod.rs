//! The evaluation tools around the service: they run it, feed it and check
//! its answers; the service never depends on them.
//!
//! * [`produce`]: `afstream produce`, synthetic workloads or files into an input topic;
//! * [`exact`]: `afstream exact`, the exact answer from the input topic, and the output against it;
//! * [`experiment`]: `afstream experiment`, failure-free against K SIGKILLs, both against the exact answer;
//! * [`convergence`]: the experiment on a distributed learner, loss over time and items;
//! * [`plots`]: an experiment's plots (SVG and PNG), drawn from its report;
//! * [`tune`]: `afstream tune`, the thresholds that meet an error budget on a sample of the input;
//! * [`demo`]: `afstream demo`, the whole story on a real broker;
//! * [`child`]: `afstream run` as a child process, and the recoveries its log records;
//! * [`observed`]: each recovery's restored state against the exact state at its resume offset.

pub mod child;
pub mod convergence;
pub mod demo;
pub mod exact;
pub mod experiment;
pub mod observed;
pub mod plots;
pub mod produce;
pub mod tune;
