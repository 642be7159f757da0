//! How an experiment's runs make their failures: SIGKILLs of one instance
//! at seeded input offsets (anywhere, mid-backup, with its state directory
//! lost), or of another instance of a group while partitions move.

use super::*;

/// Runs the pipeline to the end of its input with `failures` SIGKILLs at
/// seeded points of its progress (the input offsets its markers cover),
/// each followed by a restart; returns the runs' logs.
pub(super) fn run_with_kills(
    config: &Config,
    path: &Path,
    options: &ExperimentOptions,
    failures: usize,
    group: &str,
    state_dir: Option<&Path>,
) -> Result<Kills, ServiceError> {
    let mut progress = Progress::new(config, group, options.partitions);
    let (points, mut rng) = kill_points(options, failures);
    let mut logs = Vec::new();
    for (i, &target) in points.iter().enumerate() {
        let log = options.dir.join(format!("{group}-{}.log", i + 1));
        if options.kill_mid_backup {
            // The process kills itself in its N-th backup with entries.
            let backup = rng.gen_range(MID_BACKUP_KILLS).to_string();
            let mut run = Run::start_with(
                path,
                log.clone(),
                true,
                &[(crate::service::runner::CRASH_IN_BACKUP, &backup)],
            )?;
            logs.push(log);
            if !run.killed()? {
                // The input ended before that backup: no more kills.
                return Ok(Kills { logs, made: i });
            }
            lose_node(state_dir, options)?;
            continue;
        }
        let mut run = Run::start(path, log.clone(), true)?;
        logs.push(log);
        let deadline = Instant::now() + KILL_DEADLINE;
        loop {
            if run.exited() {
                // The input ended before this kill point: no more kills.
                run.wait()?;
                return Ok(Kills { logs, made: i });
            }
            if run.started_tasks() >= options.partitions && progress.covered()? >= target {
                run.kill();
                lose_node(state_dir, options)?;
                break;
            }
            if Instant::now() > deadline {
                return Err(ServiceError::Child(format!(
                    "{group}: {target} items not covered within {KILL_DEADLINE:?}; see {}",
                    run.log().display()
                )));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    let log = options.dir.join(format!("{group}-final.log"));
    Run::start(path, log.clone(), true)?.wait()?;
    logs.push(log);
    Ok(Kills {
        logs,
        made: points.len(),
    })
}

/// The kill points of a run: input offsets its markers must cover (summed
/// over the partitions), seeded, in order; and the generator for what else
/// the kills draw.
pub(super) fn kill_points(options: &ExperimentOptions, failures: usize) -> (Vec<u64>, StdRng) {
    let mut rng = StdRng::seed_from_u64(options.seed ^ 0xfa11);
    let mut points: Vec<f64> = (0..failures).map(|_| rng.gen_range(0.05..0.9)).collect();
    points.sort_by(f64::total_cmp);
    let items = options.items as f64;
    (points.into_iter().map(|f| (f * items) as u64).collect(), rng)
}

/// How much of the input a run's markers cover: the sum over the partitions
/// of the input offset of each one's last marker.
struct Progress<'a> {
    config: &'a Config,
    topic: String,
    partitions: i32,
    /// Made at the first look, once a task has started (and so created the
    /// changelog): a client made before the topic exists would not see it.
    changelog: Option<ChangelogLoader>,
}

impl<'a> Progress<'a> {
    pub(super) fn new(config: &'a Config, group: &str, partitions: usize) -> Self {
        Progress {
            config,
            topic: config.pipeline.changelog_topic(group),
            partitions: partitions as i32,
            changelog: None,
        }
    }

    /// Call only once the run's tasks have started.
    fn covered(&mut self) -> Result<u64, ServiceError> {
        let changelog = match &mut self.changelog {
            Some(changelog) => changelog,
            none => none.insert(ChangelogLoader::new(&self.config.kafka, &self.topic)?),
        };
        Ok((0..self.partitions)
            .filter_map(|p| changelog.last_marker(p).ok().flatten())
            .map(|marker| marker.input_offset)
            .sum())
    }
}

/// After a kill during a rebalance: a seeded delay, in milliseconds, from the
/// joining instance's assignment to its SIGKILL (its tasks restore, write their
/// start markers and take their first items in this time, so some kills come
/// before a task starts and some after).
const REBALANCE_KILL_DELAY_MS: std::ops::Range<u64> = 0..2_000;

/// The longest the other instances may take to start a killed instance's
/// partitions again: the group notices the death after `session.timeout.ms`.
const MOVE_DEADLINE: Duration = Duration::from_secs(120);

/// A run with several instances in one group (see
/// [`ExperimentOptions::instances`]): the first ones run throughout; the last
/// one joins, is killed (at a kill point, or during the rebalance its joining
/// starts), its partitions move to the others, and it joins again for the next
/// kill. At the end the others stop cleanly and one instance runs the rest of
/// the input. Returns the runs' logs, the final run's last.
///
/// The instance killed is the one that joined last, never the group's first
/// member (its leader, as a rule): Tansu 0.6.0, the project's test broker,
/// keeps a dead leader's id in the group and gives the survivors no partitions
/// again (measured: none for over 90 s, eager or cooperative).
pub(super) fn run_with_moves(
    config: &Config,
    instances: &[(PathBuf, Option<PathBuf>)],
    options: &ExperimentOptions,
    failures: usize,
    group: &str,
    mut feed: Option<InputFeed<'_>>,
) -> Result<Kills, ServiceError> {
    let mut progress = Progress::new(config, group, options.partitions);
    let (points, mut rng) = kill_points(options, failures);
    let Some(((joiner, joiner_state), stayers)) = instances.split_last() else {
        return Ok(Kills {
            logs: Vec::new(),
            made: 0,
        });
    };
    let share = |items: u64| items as f64 / options.items.max(1) as f64;
    if let Some(feed) = feed.as_mut() {
        feed.to(points.first().map_or(1.0, |&p| share(p)))?;
    }
    let mut logs = Vec::new();
    let mut runs = Vec::new();
    for (k, (path, _)) in stayers.iter().enumerate() {
        let log = options.dir.join(format!("{group}-instance{}.log", k + 1));
        runs.push(Run::start(path, log.clone(), false)?);
        logs.push(log);
    }
    let partitions = options.partitions;
    wait_until(group, "the first instances' tasks", &mut runs, |runs| {
        Ok(runs.iter().map(Run::started_tasks).sum::<usize>() >= partitions)
    })?;
    let last = stayers.len();
    for (i, &point) in points.iter().enumerate() {
        let log = options.dir.join(format!("{group}-joined-{}.log", i + 1));
        let next = points.get(i + 1).map_or(1.0, |&p| share(p));
        if options.kill_mid_rebalance {
            if feed.is_none() {
                let covered = format!("{point} items covered by markers");
                wait_until(group, &covered, &mut runs, |_| Ok(progress.covered()? >= point))?;
            }
            runs.push(Run::start(joiner, log.clone(), false)?);
            if let Some(feed) = feed.as_mut() {
                // The rebalance happens while new input arrives.
                feed.to(next)?;
            }
            wait_until(
                group,
                "partitions assigned to the joining instance",
                &mut runs,
                |runs| Ok(!runs[last].assigned().is_empty()),
            )?;
            std::thread::sleep(Duration::from_millis(rng.gen_range(REBALANCE_KILL_DELAY_MS)));
        } else {
            runs.push(Run::start(joiner, log.clone(), false)?);
            wait_until(group, "tasks started by the joining instance", &mut runs, |runs| {
                Ok(runs[last].started_tasks() > 0)
            })?;
            let target = match feed.as_mut() {
                // Half of the part written now: the kill comes while the
                // group reads it.
                Some(feed) => {
                    let before = progress.covered()?;
                    let written = feed.to(next)?;
                    before + written / 2
                }
                None => point,
            };
            wait_for_coverage(group, &mut runs, &mut progress, target)?;
        }
        logs.push(log);
        let Some(mut killed) = runs.pop() else { break };
        let starts_before = starts(&runs);
        killed.kill();
        let moved = killed.assigned();
        lose_node(joiner_state.as_deref(), options)?;
        let what = format!("the killed instance's partitions {moved:?} started again by the others");
        wait_until_within(MOVE_DEADLINE, group, &what, &mut runs, |runs| {
            let now = starts(runs);
            Ok(moved.iter().all(|p| now.get(p) > starts_before.get(p)))
        })?;
    }
    if let Some(feed) = feed.as_mut() {
        feed.to(1.0)?;
    }
    for run in &mut runs {
        run.stop()?;
    }
    let log = options.dir.join(format!("{group}-final.log"));
    Run::start(&instances[0].0, log.clone(), true)?.wait()?;
    logs.push(log);
    Ok(Kills {
        logs,
        made: points.len(),
    })
}

/// How long coverage may stand still before a kill comes anyway: the input
/// written so far is read, and what markers leave uncovered at its end (less
/// than a backup's lead of items a task) waits for input that is not coming.
const COVERAGE_STILL: Duration = Duration::from_secs(2);

/// Waits until the run's markers cover `target` items, or cover all they will
/// of the input written so far (coverage still for `COVERAGE_STILL`).
fn wait_for_coverage(
    group: &str,
    runs: &mut [Run],
    progress: &mut Progress<'_>,
    target: u64,
) -> Result<(), ServiceError> {
    let mut last = (progress.covered()?, Instant::now());
    wait_until(group, &format!("{target} items covered by markers"), runs, |_| {
        let covered = progress.covered()?;
        if covered != last.0 {
            last = (covered, Instant::now());
        }
        Ok(covered >= target || last.1.elapsed() > COVERAGE_STILL)
    })
}

/// A run's own copy of the experiment's input, written in parts while the run
/// goes on, partition by partition and in order, so that it is laid out as
/// the input is: an instance that joins has new input to read, and the kill
/// that follows comes mid-stream rather than after the group has read it all.
pub(super) struct InputFeed<'a> {
    kafka: &'a KafkaConfig,
    reader: TopicReader,
    source: String,
    target: String,
    /// Each source partition's records, and how many of them are copied.
    ends: Vec<i64>,
    copied: Vec<i64>,
}

impl<'a> InputFeed<'a> {
    pub(super) fn new(
        kafka: &'a KafkaConfig,
        source: &str,
        target: &str,
        partitions: usize,
    ) -> Result<Self, ServiceError> {
        ensure_topics(
            kafka,
            &[TopicSpec {
                name: target,
                partitions,
                compacted: false,
            }],
        )?;
        let reader = TopicReader::new(kafka, "feed")?;
        let ends = (0..partitions as i32)
            .map(|p| reader.watermarks(source, p).map(|(_, high)| high))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ServiceError::Unsupported(format!("reading {source}: {e}")))?;
        Ok(InputFeed {
            kafka,
            reader,
            source: source.to_string(),
            target: target.to_string(),
            copied: vec![0; ends.len()],
            ends,
        })
    }

    /// Copies every partition up to `share` of its records; returns how many
    /// records it copied now.
    fn to(&mut self, share: f64) -> Result<u64, ServiceError> {
        let mut written = 0;
        for (partition, (&end, copied)) in self.ends.iter().zip(self.copied.iter_mut()).enumerate() {
            let upto = ((end as f64) * share.clamp(0.0, 1.0)).round() as i64;
            if upto <= *copied {
                continue;
            }
            let mut records = Vec::new();
            self.reader
                .read(&self.source, partition as i32, *copied, upto, |message| {
                    records.push(InputRecord {
                        key: rdkafka::Message::key(message).map(<[u8]>::to_vec),
                        value: rdkafka::Message::payload(message).unwrap_or_default().to_vec(),
                    });
                })
                .map_err(|e| ServiceError::Unsupported(format!("reading {}: {e}", self.source)))?;
            let options = ProduceOptions {
                partition: Some(partition as i32),
                ..ProduceOptions::default()
            };
            written += produce_from(
                self.kafka,
                &self.target,
                self.ends.len(),
                records.into_iter().map(Ok),
                &options,
            )?
            .records;
            *copied = upto;
        }
        Ok(written)
    }
}

/// Each partition's task starts over these runs.
fn starts(runs: &[Run]) -> std::collections::HashMap<i32, usize> {
    let mut all = std::collections::HashMap::new();
    for run in runs {
        for (partition, times) in run.starts() {
            *all.entry(partition).or_insert(0) += times;
        }
    }
    all
}

fn logs_named(runs: &[Run]) -> String {
    runs.iter()
        .map(|run| run.log().display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Fails if one of the runs has exited: they run until stopped.
fn check_alive(group: &str, runs: &mut [Run]) -> Result<(), ServiceError> {
    for run in runs.iter_mut() {
        run.check_alive()
            .map_err(|e| ServiceError::Child(format!("{group}: {e}")))?;
    }
    Ok(())
}

/// Waits (at most `KILL_DEADLINE`) until `done`, while every run keeps running.
fn wait_until(
    group: &str,
    what: &str,
    runs: &mut [Run],
    done: impl FnMut(&[Run]) -> Result<bool, ServiceError>,
) -> Result<(), ServiceError> {
    wait_until_within(KILL_DEADLINE, group, what, runs, done)
}

/// Waits (at most `patience`) until `done`, while every run keeps running.
fn wait_until_within(
    patience: Duration,
    group: &str,
    what: &str,
    runs: &mut [Run],
    mut done: impl FnMut(&[Run]) -> Result<bool, ServiceError>,
) -> Result<(), ServiceError> {
    let deadline = Instant::now() + patience;
    loop {
        check_alive(group, runs)?;
        if done(runs)? {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(ServiceError::Child(format!(
                "{group}: {what}: not within {patience:?}; see {}",
                logs_named(runs)
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The kinds of kill that go together, and the instances they need.
pub(super) fn validate_kills(options: &ExperimentOptions) -> Result<(), ServiceError> {
    let refuse = |why: String| Err(ServiceError::Unsupported(why));
    if options.instances == 0 {
        return refuse("--instances must be 1 or more".into());
    }
    if options.kill_mid_rebalance && options.instances < 2 {
        return refuse("--kill-mid-rebalance needs --instances 2 or more: a rebalance needs a member to join".into());
    }
    if options.kill_mid_backup && options.instances > 1 {
        return refuse("--kill-mid-backup runs one instance; it does not combine with --instances".into());
    }
    if options.instances > options.partitions {
        return refuse(format!(
            "--instances {} needs as many partitions (--partitions {}): an instance without one has nothing to lose",
            options.instances, options.partitions
        ));
    }
    Ok(())
}

/// What a run with kills left: its processes' logs (the last one's last) and
/// how many kills it made (fewer than asked when the input ended first).
pub(super) struct Kills {
    pub(super) logs: Vec<PathBuf>,
    pub(super) made: usize,
}

/// Which backup (with entries) of a process a mid-backup kill comes in: early
/// enough that every process of a short run reaches it, late enough that each
/// makes progress.
const MID_BACKUP_KILLS: std::ops::RangeInclusive<u64> = 2..=8;

/// With node loss, the machine is gone with its disk: the restart restores
/// from the changelog.
fn lose_node(state_dir: Option<&Path>, options: &ExperimentOptions) -> Result<(), ServiceError> {
    let Some(dir) = state_dir.filter(|_| options.node_loss) else {
        return Ok(());
    };
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(ServiceError::Child(format!("deleting {}: {e}", dir.display())))
        }
        _ => Ok(()),
    }
}
