//! What the broker tests share: a real broker (the project's own, or the one
//! named by `AFSTREAM_TEST_BOOTSTRAP`), `afstream run` child processes, and
//! reading topics back. Every wait has a deadline and names what it waited for.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use afstream::service::config::KafkaConfig;
use afstream::service::kafka::{partition_count, TopicReader};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

/// Set to a bootstrap address to run the suite against that cluster instead of
/// a broker of its own.
pub const ENV_TEST_BOOTSTRAP: &str = "AFSTREAM_TEST_BOOTSTRAP";

/// A directory of a test's own, emptied first.
pub fn test_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("afstream-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the test directory");
    dir
}

/// A name no earlier run used, so tests against a shared cluster never collide.
pub fn unique(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{name}-{}-{}", std::process::id(), nanos % 1_000_000_000)
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A broker for one test, stopped when dropped.
pub struct Broker {
    pub address: String,
    dir: Option<PathBuf>,
    /// The broker's process, so it is stopped even if its directory is gone.
    pid: std::cell::Cell<Option<u32>>,
}

/// The pid `scripts/broker` recorded in a broker's directory.
fn broker_pid(dir: &Path) -> Option<u32> {
    std::fs::read_to_string(dir.join("broker.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl Broker {
    pub fn start(dir: &Path) -> Broker {
        if let Ok(address) = std::env::var(ENV_TEST_BOOTSTRAP) {
            return Broker {
                address,
                dir: None,
                pid: std::cell::Cell::new(None),
            };
        }
        let dir = dir.join("broker");
        let output = Command::new("timeout")
            .arg("180")
            .arg(repo().join("scripts/broker"))
            .arg("start")
            .arg(&dir)
            .output()
            .expect("run scripts/broker");
        assert!(
            output.status.success(),
            "scripts/broker start failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let address = String::from_utf8_lossy(&output.stdout).trim().to_string();
        assert!(!address.is_empty(), "scripts/broker start printed no address");
        Broker {
            address,
            pid: std::cell::Cell::new(broker_pid(&dir)),
            dir: Some(dir),
        }
    }

    /// Whether this is the project's own broker (not a cluster named by the
    /// environment).
    pub fn is_own(&self) -> bool {
        self.dir.is_some()
    }

    /// The process of the project's own broker (none for a cluster).
    pub fn pid(&self) -> Option<u32> {
        self.pid.get()
    }

    /// Kills the project's own broker (SIGKILL: it goes away at once), keeps it
    /// down for `down`, then starts it again on the same port and data (its
    /// SQLite engine keeps every topic and offset).
    pub fn outage(&self, down: Duration) {
        self.go_down();
        std::thread::sleep(down);
        self.come_back();
    }

    /// The first half of an outage: SIGKILLs the project's own broker.
    pub fn go_down(&self) {
        self.script("kill", "60");
    }

    /// The second half of an outage: starts the broker again on its port and data.
    pub fn come_back(&self) {
        self.script("restart", "180");
        if let Some(dir) = &self.dir {
            self.pid.set(broker_pid(dir));
        }
    }

    fn script(&self, command: &str, deadline: &str) {
        let dir = self.dir.as_ref().expect("an outage needs the project's own broker");
        let output = Command::new("timeout")
            .arg(deadline)
            .arg(repo().join("scripts/broker"))
            .arg(command)
            .arg(dir)
            .output()
            .expect("run scripts/broker");
        assert!(
            output.status.success(),
            "scripts/broker {command} failed ({}): {}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }

    pub fn kafka(&self) -> KafkaConfig {
        KafkaConfig {
            properties: [("consumer.fetch.wait.max.ms".to_string(), "10".to_string())].into(),
            ..KafkaConfig::new(self.address.clone())
        }
    }

    fn client(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.address);
        config.set("fetch.wait.max.ms", "10");
        config
    }

    /// Every record of `topic` up to the end it has now, per partition in order.
    pub fn read_topic(&self, topic: &str) -> Vec<Record> {
        let partitions = partition_count(&self.kafka(), topic)
            .expect("read the topic's metadata")
            .unwrap_or_else(|| panic!("topic {topic} does not exist"));
        let mut kafka = self.kafka();
        kafka.group_id = unique("reader");
        let reader = TopicReader::new(&kafka, "test").expect("create a reader");
        let mut records = Vec::new();
        for partition in 0..partitions as i32 {
            reader
                .read_all(topic, partition, |m| {
                    records.push(Record {
                        partition,
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec).unwrap_or_default(),
                        headers: m
                            .headers()
                            .map(|headers| {
                                headers
                                    .iter()
                                    .map(|h| {
                                        let value = String::from_utf8_lossy(h.value.unwrap_or_default());
                                        (h.key.to_string(), value.into_owned())
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                    })
                })
                .unwrap_or_else(|e| panic!("reading {topic}[{partition}]: {e}"));
        }
        records
    }

    /// Records in `topic` now, over all partitions.
    pub fn record_count(&self, topic: &str) -> i64 {
        let consumer: BaseConsumer = self.client().create().expect("create a client");
        let metadata = consumer
            .fetch_metadata(Some(topic), Duration::from_secs(10))
            .expect("read the topic's metadata");
        let partitions = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .map_or(0, |t| t.partitions().len());
        (0..partitions as i32)
            .map(|p| {
                consumer
                    .fetch_watermarks(topic, p, Duration::from_secs(10))
                    .map(|(low, high)| high - low)
                    .unwrap_or(0)
            })
            .sum()
    }

    /// Commits `offset` for `group` on a partition, as an earlier run would have.
    pub fn commit(&self, group: &str, topic: &str, partition: i32, offset: i64) {
        let consumer: BaseConsumer = self
            .client()
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()
            .expect("create a committer");
        let mut offsets = TopicPartitionList::new();
        offsets
            .add_partition_offset(topic, partition, Offset::Offset(offset))
            .expect("offsets");
        consumer.commit(&offsets, CommitMode::Sync).expect("commit an offset");
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = Command::new("timeout")
                .arg("60")
                .arg(repo().join("scripts/broker"))
                .arg("stop")
                .arg(dir)
                .status();
            // Whatever happened to its directory, the process goes (if that
            // pid is still a broker, not a process that reused it).
            if let Some(pid) = self.pid.get() {
                let command = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&command).contains("tansu") {
                    let _ = Command::new("kill").arg("-KILL").arg(pid.to_string()).status();
                }
                // Gone before its directory is removed: a broker still writing
                // its database made the removal fail and left it behind.
                let deadline = Instant::now() + Duration::from_secs(10);
                while Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            // A passing test leaves nothing behind; a failing one keeps its logs.
            if !std::thread::panicking() {
                if let Some(test_dir) = dir.parent() {
                    let _ = std::fs::remove_dir_all(test_dir);
                }
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub value: Vec<u8>,
    pub headers: Vec<(String, String)>,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// The last value of every key (what a compacted output topic keeps).
pub fn latest_by_key(records: &[Record]) -> HashMap<String, String> {
    records
        .iter()
        .filter_map(|r| {
            let key = String::from_utf8_lossy(r.key.as_deref()?).into_owned();
            Some((key, String::from_utf8_lossy(&r.value).into_owned()))
        })
        .collect()
}

/// An `afstream run` child process, killed if the test ends early.
pub struct Service {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Service {
    pub fn start(config: &Path, log: &Path, stop_at_end: bool) -> Service {
        Self::spawn(Command::new(env!("CARGO_BIN_EXE_afstream")), config, log, stop_at_end)
    }

    /// [`Service::start`] with `env` added to its environment.
    pub fn start_with_env(config: &Path, log: &Path, stop_at_end: bool, env: &[(&str, &str)]) -> Service {
        let mut command = Command::new(env!("CARGO_BIN_EXE_afstream"));
        command.envs(env.iter().copied());
        Self::spawn(command, config, log, stop_at_end)
    }

    /// Runs one pipeline of a file of several, until stopped.
    pub fn start_pipeline(config: &Path, log: &Path, pipeline: &str) -> Service {
        let mut command = Command::new(env!("CARGO_BIN_EXE_afstream"));
        command.args(["run", "--pipeline", pipeline]);
        Self::spawn_run(command, config, log, false)
    }

    /// Starts `afstream run` with every file it writes limited to `kib` KiB
    /// (`ulimit -f`, with SIGXFSZ ignored): a write past it fails with EFBIG, as
    /// one fails with ENOSPC on a full disk.
    pub fn start_with_file_size_limit(config: &Path, log: &Path, kib: u64) -> Service {
        let mut command = Command::new("bash");
        command.args([
            "-c",
            r#"trap '' XFSZ; ulimit -f "$0" && exec "$@""#,
            &kib.to_string(),
            env!("CARGO_BIN_EXE_afstream"),
        ]);
        Self::spawn(command, config, log, true)
    }

    fn spawn(mut command: Command, config: &Path, log: &Path, stop_at_end: bool) -> Service {
        command.arg("run");
        Self::spawn_run(command, config, log, stop_at_end)
    }

    /// Starts `command` (an `afstream run` short of its config) with the config,
    /// logging to `log`.
    fn spawn_run(mut command: Command, config: &Path, log: &Path, stop_at_end: bool) -> Service {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .expect("open the service log");
        command
            .arg("--config")
            .arg(config)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file);
        if stop_at_end {
            command.arg("--stop-at-end");
        }
        let child = command.spawn().expect("start afstream run");
        Service {
            child: Some(child),
            log: log.to_path_buf(),
        }
    }

    fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("the service runs")
    }

    /// SIGKILL: no clean stop at all.
    pub fn kill(mut self) {
        let child = self.child();
        child.kill().expect("SIGKILL the service");
        let _ = child.wait();
        self.child = None;
    }

    /// Sends `signal` (`STOP`, `CONT`, ...) to the process.
    pub fn signal(&mut self, signal: &str) {
        let pid = self.child().id().to_string();
        let sent = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("run kill");
        assert!(sent.success(), "SIG{signal} to afstream run {pid}");
    }

    /// SIGTERM, then waits for the clean stop to finish.
    pub fn terminate(mut self, within: Duration) -> ExitStatus {
        let pid = self.child().id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().expect("run kill");
        assert!(sent.success(), "SIGTERM to afstream run {pid}");
        self.wait(within, "a clean stop after SIGTERM")
    }

    /// Waits for the process to exit by itself.
    pub fn wait(&mut self, within: Duration, what: &str) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child().try_wait().expect("poll the service") {
                self.child = None;
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child().kill();
                let _ = self.child().wait();
                self.child = None;
                panic!(
                    "afstream run: {what} did not happen within {within:?}; log:\n{}",
                    tail(&self.log)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until `ready()` holds while the service runs.
    pub fn wait_until(&mut self, within: Duration, what: &str, mut ready: impl FnMut() -> bool) {
        let deadline = Instant::now() + within;
        while !ready() {
            if let Some(status) = self.child().try_wait().expect("poll the service") {
                self.child = None;
                panic!(
                    "afstream run exited ({status}) while waiting for {what}; log:\n{}",
                    tail(&self.log)
                );
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {within:?}; log:\n{}",
                tail(&self.log)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The last lines of a log, for failure messages.
pub fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Log lines of the service that contain `needle`.
pub fn log_lines(log: &Path, needle: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_string)
        .collect()
}

/// A loopback port nothing listens on now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The text of `http://127.0.0.1:PORT/metrics`, or `None` while nothing answers.
pub fn scrape(port: u16) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (_, body) = response.split_once("\r\n\r\n")?;
    Some(body.to_string())
}

/// The sum of a metric's samples whose labels contain every `label="value"` given.
pub fn metric(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else { continue };
        if !(rest.starts_with('{') || rest.starts_with(' ')) || !labels.iter().all(|l| rest.contains(l)) {
            continue;
        }
        let value: f64 = rest.rsplit(' ').next()?.parse().ok()?;
        *found.get_or_insert(0.0) += value;
    }
    found
}

/// Writes a distributed learner's config (`workers` and `average`, the model
/// and feedback topics named after `group`); `operator` is the parameters
/// both stages share, as inline-table entries.
pub fn write_learner_config(path: &Path, address: &str, group: &str, input: &str, operator: &str) {
    let config = format!(
        r#"
[kafka]
bootstrap_servers = "{address}"
group_id = "{group}"
properties = {{ "consumer.fetch.wait.max.ms" = "10" }}

[pipelines.workers]
input_topic = "{input}"
output_topic = "{group}-models"
feedback_topic = "{group}-feedback"
format = "json"
operator = {{ kind = "sgd_worker", {operator} }}

[pipelines.average]
input_topic = "{group}-models"
output_topic = "{group}-feedback"
format = "json"
operator = {{ kind = "model_averager", {operator} }}
fault_tolerance = {{ mode = "approximate", theta = 1.0, max_uncovered = 300, max_unacked = 300 }}
"#
    );
    std::fs::write(path, config).expect("write the learner's config");
}

/// A Prometheus server (Debian's `prometheus`, which `scripts/prerequisites`
/// installs) scraping one afstream instance with the shipped scrape config
/// and alert rules, its target rewritten to the instance's metrics port.
pub struct Prometheus {
    child: Child,
    port: u16,
}

impl Prometheus {
    pub fn start(dir: &Path, metrics_port: u16) -> Self {
        let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/monitoring");
        let config = std::fs::read_to_string(shipped.join("prometheus.yml")).expect("the shipped prometheus.yml");
        let config = config
            .replace("word-count:9464", &format!("127.0.0.1:{metrics_port}"))
            .replace("scrape_interval: 5s", "scrape_interval: 1s")
            .replace("evaluation_interval: 5s", "evaluation_interval: 1s");
        assert!(
            config.contains(&format!("127.0.0.1:{metrics_port}")),
            "the target was not rewritten"
        );
        let home = dir.join("prometheus");
        std::fs::create_dir_all(&home).expect("prometheus's directory");
        std::fs::write(home.join("prometheus.yml"), config).expect("write prometheus.yml");
        std::fs::copy(shipped.join("alerts.yml"), home.join("alerts.yml")).expect("copy alerts.yml");
        let port = free_port();
        let log = std::fs::File::create(home.join("prometheus.log")).expect("prometheus's log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", home.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", home.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .expect("start prometheus (scripts/prerequisites installs Debian's prometheus)");
        Prometheus { child, port }
    }

    /// A GET of Prometheus's HTTP API, parsed; `None` while it does not answer.
    pub fn get(&self, path_and_query: &str) -> Option<serde_json::Value> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let request = format!("GET {path_and_query} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).ok()?;
        let (head, body) = response.split_once("\r\n\r\n")?;
        // A chunked body (Go's default without a length) is one chunk here.
        let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            body.split_once("\r\n").map(|(_, rest)| rest).unwrap_or(body)
        } else {
            body
        };
        let end = body.rfind('}')?;
        serde_json::from_str(&body[..=end]).ok()
    }

    /// The samples of an instant query: each series' labels and value.
    pub fn query(&self, expr: &str) -> Vec<(HashMap<String, String>, f64)> {
        let encoded: String = expr
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
                _ => format!("%{b:02X}"),
            })
            .collect();
        let Some(answer) = self.get(&format!("/api/v1/query?query={encoded}")) else {
            return Vec::new();
        };
        let results = answer["data"]["result"].as_array().cloned().unwrap_or_default();
        results
            .iter()
            .filter_map(|series| {
                let labels = series["metric"]
                    .as_object()?
                    .iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect();
                let value = series["value"][1].as_str()?.parse().ok()?;
                Some((labels, value))
            })
            .collect()
    }

    /// Waits until `ready` holds, asking again every 200 ms.
    pub fn wait_until(&mut self, within: Duration, what: &str, mut ready: impl FnMut(&Self) -> bool) {
        let deadline = Instant::now() + within;
        while !ready(self) {
            if let Some(status) = self.child.try_wait().expect("poll prometheus") {
                panic!("prometheus exited ({status}) while waiting for {what}");
            }
            assert!(Instant::now() < deadline, "{what}: not within {within:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
