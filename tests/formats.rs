//! What users touch, on a real broker: `afstream produce` from a file as Avro
//! in Confluent's wire format, a pipeline reading and writing it, and `afstream
//! exact` computing the answer from the same topic.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use afstream::service::produce::{produce, InputRecord};
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
    let _ = std::fs::remove_dir_all(&dir);
}
