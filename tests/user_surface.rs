//! What users touch, on a real broker: `afstream produce` from a file as Avro
//! in Confluent's wire format, a pipeline reading and writing it, `afstream
//! exact` computing the answer from the same topic, and a file of several
//! pipelines.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use afstream::eval::produce::{produce, InputRecord};
use common::{test_dir, unique, Broker, Service};

const RUN_DEADLINE: Duration = Duration::from_secs(120);

/// Runs the `afstream` binary under `timeout`, so nothing hangs.
fn afstream(args: &[&str]) -> Output {
    Command::new("timeout")
        .arg("120")
        .arg(env!("CARGO_BIN_EXE_afstream"))
        .args(args)
        .env_remove("AFSTREAM_BOOTSTRAP_SERVERS")
        .env_remove("AFSTREAM_METRICS_ADDRESS")
        .output()
        .expect("run afstream")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Rows of keyed numbers (integers, so sums are exact in any order), and their sums.
fn keyed_rows(rows: usize) -> (String, BTreeMap<String, f64>) {
    let mut csv = String::from("key,value\n");
    let mut sums = BTreeMap::new();
    for i in 0..rows {
        let key = format!("k{}", (i * i + 7 * i) % 397);
        let value = (i % 11) as f64 - 5.0;
        csv.push_str(&format!("{key},{value}\n"));
        *sums.entry(key).or_insert(0.0) += value;
    }
    (csv, sums)
}

fn write_config(path: &Path, broker: &Broker, group: &str, input: &str, output: &str) {
    let config = format!(
        r#"
[kafka]
bootstrap_servers = "{address}"
group_id = "{group}"
properties = {{ "consumer.fetch.wait.max.ms" = "10" }}

[pipeline]
input_topic = "{input}"
output_topic = "{output}"
format = "avro"

[pipeline.avro]
input_framing = "confluent"
input_schema_id = 3
output_schema_id = 4

[pipeline.operator]
kind = "keyed_aggregation"
aggregate = "sum"
max_abs_value = 100.0

[pipeline.fault_tolerance]
mode = "approximate"
theta = 1000.0
max_uncovered = 200
max_unacked = 2000
"#,
        address = broker.address
    );
    std::fs::write(path, config).expect("write the config");
}

#[test]
fn a_csv_file_produced_as_confluent_avro_gives_the_exact_answer_through_the_pipeline() {
    let dir = test_dir("formats-avro");
    let broker = Broker::start(&dir);
    let group = unique("avro-sums");
    let (input, output) = (format!("{group}-in"), format!("{group}-out"));
    let (csv, sums) = keyed_rows(8_000);
    let data = dir.join("amounts.csv");
    std::fs::write(&data, csv).expect("write the CSV");

    let produced = afstream(&[
        "produce",
        "--bootstrap-servers",
        &broker.address,
        "--topic",
        &input,
        "--partitions",
        "2",
        "--workload",
        "keyed",
        "--file",
        &data.to_string_lossy(),
        "--format",
        "avro",
        "--schema-id",
        "3",
    ]);
    assert!(produced.status.success(), "produce failed: {}", text(&produced.stderr));
    let said = text(&produced.stdout);
    assert!(
        said.contains("wrote 8000 Keyed records") && said.contains("schema id 3"),
        "{said}"
    );
    // Two records the pipeline must refuse, not misread: another schema id, and no framing at all.
    let strangers = [
        InputRecord {
            key: Some(b"k1".to_vec()),
            value: vec![0, 0, 0, 0, 9, 4, b'k', b'1', 0, 0, 0, 0, 0, 0, 0xf0, 0x3f],
        },
        InputRecord {
            key: Some(b"k1".to_vec()),
            value: b"k1,1".to_vec(),
        },
    ];
    produce(&broker.kafka(), &input, 2, &strangers).expect("produce the strangers");

    let config = dir.join("sums.toml");
    write_config(&config, &broker, &group, &input, &output);
    let mut service = Service::start(&config, &dir.join("run.log"), true);
    let status = service.wait(RUN_DEADLINE, "processing the input to its end");
    assert!(
        status.success(),
        "afstream run failed; log:\n{}",
        common::tail(&service.log)
    );

    let outputs = broker.read_topic(&output);
    assert!(outputs.len() >= 8_000, "{} outputs", outputs.len());
    for record in &outputs {
        assert_eq!(
            &record.value[..5],
            &[0, 0, 0, 0, 4],
            "Confluent framing with schema id 4"
        );
    }
    let dead = broker.read_topic(&format!("{group}-dead-letters"));
    let mut reasons: Vec<&str> = dead.iter().filter_map(|r| r.header("afstream.reason")).collect();
    reasons.sort();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons[0].contains("magic byte 0x6b"), "{reasons:?}");
    assert!(reasons[1].contains("schema id 9"), "{reasons:?}");

    let exact = afstream(&["exact", "--config", &config.to_string_lossy(), "--compare", "--json"]);
    assert!(exact.status.success(), "exact failed: {}", text(&exact.stderr));
    let report: serde_json::Value = serde_json::from_slice(&exact.stdout).expect("a JSON report");
    assert_eq!(report["input_records"], 8_002, "{report}");
    assert_eq!(report["refused_records"], 2, "{report}");
    let values = report["answer"]["values"].as_object().expect("values per key");
    assert_eq!(values.len(), sums.len());
    for (key, sum) in &sums {
        assert_eq!(values[key].as_f64(), Some(*sum), "the exact sum of {key}");
    }
    let comparison = &report["comparison"];
    assert_eq!(comparison["l1_error"], 0.0, "{comparison}");
    assert_eq!(
        comparison["output_keys"].as_u64(),
        Some(sums.len() as u64),
        "{comparison}"
    );
    assert!(
        comparison["missing_keys"].as_array().is_some_and(Vec::is_empty),
        "{comparison}"
    );

    // --rate paces the records: 500 at 1 000 a second take at least half a second.
    let paced = afstream(&[
        "produce",
        "--bootstrap-servers",
        &broker.address,
        "--topic",
        &format!("{group}-paced"),
        "--workload",
        "text",
        "--items",
        "500",
        "--rate",
        "1000",
    ]);
    assert!(paced.status.success(), "paced produce failed: {}", text(&paced.stderr));
    let said = text(&paced.stdout);
    let seconds: f64 = said
        .split(" in ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no duration in {said:?}"));
    assert!(seconds >= 0.49, "500 records at 1 000/s took {seconds} s: {said}");

    // A bad row stops produce with its line; the rows before it are written.
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, "key,value\na,1\nb,lots\nc,2\n").expect("write the CSV");
    let failed = afstream(&[
        "produce",
        "--bootstrap-servers",
        &broker.address,
        "--topic",
        &format!("{group}-bad"),
        "--workload",
        "keyed",
        "--file",
        &bad.to_string_lossy(),
    ]);
    let said = text(&failed.stderr);
    assert!(!failed.status.success(), "a bad row passed");
    assert!(
        said.contains("bad.csv line 3") && said.contains("the 1 records before it were written"),
        "{said}"
    );
}

#[test]
fn a_file_of_two_pipelines_runs_both_on_one_input_each_in_its_own_group() {
    let dir = test_dir("two-pipelines");
    let broker = Broker::start(&dir);
    let group = unique("text");
    let input = format!("{group}-lines");
    let lines: Vec<InputRecord> = (0..4_000)
        .map(|i| InputRecord {
            key: None,
            value: if i % 7 == 0 {
                format!("disk error on w{}", i % 13).into_bytes()
            } else {
                format!("w{} w{} w{}", i % 17, i % 29, i % 101).into_bytes()
            },
        })
        .collect();
    let errors = lines.iter().filter(|l| l.value.starts_with(b"disk error")).count();
    produce(&broker.kafka(), &input, 1, &lines).expect("produce the lines");
    let config = dir.join("text.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[kafka]
bootstrap_servers = "{address}"
group_id = "{group}"
properties = {{ "consumer.fetch.wait.max.ms" = "10" }}

[pipelines.counts]
input_topic = "{input}"
output_topic = "{group}-counts"
format = "text"
operator = {{ kind = "word_count", max_words_per_line = 10 }}
fault_tolerance = {{ mode = "approximate", theta = 1000.0, max_uncovered = 200, max_unacked = 2000 }}

[pipelines.errors]
input_topic = "{input}"
output_topic = "{group}-errors"
format = "text"
operator = {{ kind = "grep", pattern = "\\berror\\b" }}
fault_tolerance = {{ mode = "approximate", theta = 1.0, max_uncovered = 200, max_unacked = 2000 }}
"#,
            address = broker.address
        ),
    )
    .expect("write the config");
    let mut service = Service::start(&config, &dir.join("run.log"), true);
    let status = service.wait(RUN_DEADLINE, "both pipelines processing the input to its end");
    assert!(
        status.success(),
        "afstream run failed; log:\n{}",
        common::tail(&service.log)
    );
    let log = std::fs::read_to_string(&service.log).expect("the log");
    for joined in [
        format!("joined group {group}-counts"),
        format!("joined group {group}-errors"),
    ] {
        assert!(
            log.contains(&joined),
            "{joined} not in the log:\n{}",
            common::tail(&service.log)
        );
    }
    let matched = broker.read_topic(&format!("{group}-errors"));
    assert_eq!(matched.len(), errors);
    assert!(matched.iter().all(|r| r.value.starts_with(b"disk error on w")));

    let exact = |name: &str| -> serde_json::Value {
        let out = afstream(&[
            "exact",
            "--config",
            &config.to_string_lossy(),
            "--pipeline",
            name,
            "--compare",
            "--json",
        ]);
        assert!(out.status.success(), "exact {name} failed: {}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).expect("a JSON report")
    };
    let counts = exact("counts");
    assert_eq!(counts["comparison"]["l1_error"], 0.0, "{counts}");
    assert_eq!(counts["answer"]["values"]["error"], errors as f64, "{counts}");
    let grep = exact("errors");
    assert_eq!(grep["answer"]["lines"], errors, "{grep}");
    assert_eq!(grep["comparison"]["difference"], 0, "{grep}");

    // One pipeline that cannot start (its input topic does not exist) stops
    // the other cleanly, and the process exits naming it.
    let broken = std::fs::read_to_string(&config).expect("the config").replace(
        &format!("input_topic = \"{input}\"\noutput_topic = \"{group}-errors\""),
        &format!("input_topic = \"{group}-missing\"\noutput_topic = \"{group}-errors\""),
    );
    let broken_config = dir.join("broken.toml");
    std::fs::write(&broken_config, broken).expect("write the config");
    let mut service = Service::start(&broken_config, &dir.join("broken.log"), false);
    let status = service.wait(RUN_DEADLINE, "the process to exit after one pipeline failed");
    assert!(
        !status.success(),
        "a pipeline failed and the process exited successfully"
    );
    let log = std::fs::read_to_string(&service.log).expect("the log");
    assert!(
        log.contains("pipeline errors:") && log.contains(&format!("{group}-missing")),
        "the error names the pipeline and its topic:\n{}",
        common::tail(&service.log)
    );
}
