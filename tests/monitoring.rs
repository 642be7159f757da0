//! The monitoring configs as Prometheus reads them: the scrape config (with
//! the alert rules it names) passes `promtool check config`, and every alert
//! fires on the series it is for and stays quiet on a healthy task
//! (`promtool test rules configs/monitoring/alerts_test.yml`).
//! `scripts/prerequisites` installs Debian's `prometheus`, which has promtool.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// Runs promtool with `args` in `configs/monitoring/`, within a deadline.
fn promtool(args: &[&str]) -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/monitoring");
    let mut child = Command::new("promtool")
        .args(args)
        .current_dir(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("promtool {args:?}: {e} (scripts/prerequisites installs Debian's prometheus)"));
    let deadline = Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("promtool's status").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("promtool {args:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("promtool's output");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn the_scrape_config_and_the_alert_rules_it_names_are_valid() {
    let text = promtool(&["check", "config", "prometheus.yml"]);
    assert!(text.contains("SUCCESS: 1 rule files found"), "{text}");
    let rules = promtool(&["check", "rules", "alerts.yml"]);
    assert!(rules.contains("SUCCESS"), "{rules}");
}

#[test]
fn every_alert_fires_on_its_series_and_not_on_a_healthy_task() {
    let text = promtool(&["test", "rules", "alerts_test.yml"]);
    assert!(text.contains("SUCCESS"), "{text}");
    // Every alert of alerts.yml has a test.
    let rules = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/monitoring/alerts.yml"))
        .expect("alerts.yml");
    let tests =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/monitoring/alerts_test.yml"))
            .expect("alerts_test.yml");
    for line in rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")) {
        assert!(
            tests.contains(&format!("alertname: {line}")),
            "alert {line} has no test in alerts_test.yml"
        );
    }
}
