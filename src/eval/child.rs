//! `afstream run` as a child process (for `afstream demo` and `afstream
//! experiment`), and what its log says about recoveries.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::service::ServiceError;

/// How long a run to the end may take.
const STEP_DEADLINE: Duration = Duration::from_secs(300);

/// A recovery as the service logged it.
#[derive(Clone, Debug, PartialEq)]
pub struct LoggedRecovery {
    pub partition: i32,
    pub failures: u32,
    pub resume_offset: u64,
    pub bound_state: f64,
    /// Outputs the failure may have repeated.
    pub bound_outputs: f64,
    /// Outputs the failure may have lost (a restart on a local store).
    pub bound_lost_outputs: f64,
    /// Opening the store, reading the last marker and restoring the state.
    pub restore_seconds: f64,
    /// The changelog offset a restore from the changelog read to (none when
    /// the task reopened its local store).
    pub changelog_end: Option<u64>,
}

/// A numeric field `name=value` of a log line.
pub fn log_field(line: &str, name: &str) -> Option<f64> {
    let start = line.find(&format!(" {name}="))? + name.len() + 2;
    line[start..].split_whitespace().next()?.parse().ok()
}

/// The recoveries a service log records.
pub fn logged_recoveries(log: &str) -> Vec<LoggedRecovery> {
    log.lines()
        .filter(|line| line.contains("recovered from a failure"))
        .filter_map(|line| {
            Some(LoggedRecovery {
                partition: log_field(line, "partition")? as i32,
                failures: log_field(line, "failures")? as u32,
                resume_offset: log_field(line, "resume_offset")? as u64,
                bound_state: log_field(line, "bound_state")?,
                bound_outputs: log_field(line, "bound_outputs").unwrap_or(0.0),
                bound_lost_outputs: log_field(line, "bound_lost_outputs").unwrap_or(0.0),
                restore_seconds: log_field(line, "restore_seconds").unwrap_or(0.0),
                changelog_end: log_field(line, "changelog_end").map(|end| end as u64),
            })
        })
        .collect()
}

/// An `afstream run` child process, killed when dropped.
pub struct Run {
    child: Option<Child>,
    log: PathBuf,
}

impl Run {
    /// Starts `afstream run --config CONFIG [--stop-at-end]`, its log in `log`.
    pub fn start(config: &Path, log: PathBuf, stop_at_end: bool) -> Result<Run, ServiceError> {
        Run::start_with(config, log, stop_at_end, &[])
    }

    /// [`Run::start`] with `env` added to the child's environment.
    pub fn start_with(
        config: &Path,
        log: PathBuf,
        stop_at_end: bool,
        env: &[(&str, &str)],
    ) -> Result<Run, ServiceError> {
        let exe = std::env::current_exe().map_err(|e| ServiceError::Child(format!("finding afstream itself: {e}")))?;
        let log_file =
            std::fs::File::create(&log).map_err(|e| ServiceError::Child(format!("{}: {e}", log.display())))?;
        let mut command = Command::new(exe);
        command
            .arg("run")
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        if stop_at_end {
            command.arg("--stop-at-end");
        }
        let child = command
            .spawn()
            .map_err(|e| ServiceError::Child(format!("starting afstream run: {e}")))?;
        Ok(Run {
            child: Some(child),
            log,
        })
    }

    /// Fails if the child has exited.
    pub fn check_alive(&mut self) -> Result<(), ServiceError> {
        if let Some(child) = self.child.as_mut() {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(ServiceError::Child(format!(
                    "afstream run exited early ({status}); see {}",
                    self.log.display()
                )));
            }
        }
        Ok(())
    }

    /// Tasks this run has started, by its log.
    pub fn started_tasks(&self) -> usize {
        self.starts().values().sum()
    }

    /// How often each partition's task started in this run (after a failure or
    /// not), by its log.
    pub fn starts(&self) -> HashMap<i32, usize> {
        let mut starts = HashMap::new();
        for line in self.log_lines() {
            if line.contains("task started") || line.contains("recovered from a failure") {
                if let Some(partition) = log_field(&line, "partition") {
                    *starts.entry(partition as i32).or_insert(0) += 1;
                }
            }
        }
        starts
    }

    /// Every partition the group assigned this run, by its log.
    pub fn assigned(&self) -> BTreeSet<i32> {
        self.log_lines()
            .iter()
            .filter(|line| line.contains("partitions assigned"))
            .filter_map(|line| line.split("partitions=[").nth(1)?.split(']').next())
            .flat_map(|list| list.split(',').filter_map(|p| p.trim().parse().ok()))
            .collect()
    }

    fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .map(|text| text.lines().map(str::to_string).collect())
            .unwrap_or_default()
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits (at most `STEP_DEADLINE`) for the clean stop.
    pub fn stop(&mut self) -> Result<(), ServiceError> {
        if let Some(child) = &self.child {
            let pid = child.id().to_string();
            let sent = Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .map_err(|e| ServiceError::Child(format!("sending SIGTERM to afstream run {pid}: {e}")))?;
            if !sent.success() {
                return Err(ServiceError::Child(format!("SIGTERM to afstream run {pid}: {sent}")));
            }
        }
        self.wait()
    }

    /// Waits (at most `STEP_DEADLINE`) for the child to kill itself (true) or
    /// to finish successfully (false); any other exit is an error.
    pub fn killed(&mut self) -> Result<bool, ServiceError> {
        use std::os::unix::process::ExitStatusExt;
        match self.exit_status("kill itself or finish")? {
            Some(status) if status.signal() == Some(9) => Ok(true),
            Some(status) if !status.success() => Err(self.failed(status)),
            _ => Ok(false),
        }
    }

    /// Waits for a successful exit (at most `STEP_DEADLINE`).
    pub fn wait(&mut self) -> Result<(), ServiceError> {
        match self.exit_status("finish")? {
            Some(status) if !status.success() => Err(self.failed(status)),
            _ => Ok(()),
        }
    }

    /// Waits (at most `STEP_DEADLINE`, then kills it) for the child to exit;
    /// `None` if it had exited already.
    fn exit_status(&mut self, what: &str) -> Result<Option<ExitStatus>, ServiceError> {
        let deadline = Instant::now() + STEP_DEADLINE;
        while let Some(child) = self.child.as_mut() {
            match child.try_wait() {
                Ok(Some(status)) => {
                    self.child = None;
                    return Ok(Some(status));
                }
                _ if Instant::now() > deadline => {
                    self.kill();
                    return Err(ServiceError::Child(format!(
                        "afstream run did not {what} within {STEP_DEADLINE:?}; see {}",
                        self.log.display()
                    )));
                }
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
        Ok(None)
    }

    fn failed(&self, status: ExitStatus) -> ServiceError {
        ServiceError::Child(format!("afstream run failed ({status}); see {}", self.log.display()))
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Run {
    /// Whether the child has exited (successfully or not).
    pub fn exited(&mut self) -> bool {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(_))) | None => true,
            Some(_) => false,
        }
    }

    pub fn log(&self) -> &Path {
        &self.log
    }
}
