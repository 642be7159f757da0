//! Tests of `codec`.

use super::*;
use std::fmt::Debug;

fn avro(framing: Framing, input_schema_id: Option<u32>, output_schema_id: Option<u32>) -> AvroConfig {
    AvroConfig {
        input_framing: framing,
        input_schema: None,
        input_schema_id,
        output_schema_id,
    }
}

/// Reads an output datum back with the operator's output schema.
fn read_output<O: ServiceOperator>(bytes: &[u8], schema_id: Option<u32>) -> Value {
    let mut body = match schema_id {
        Some(id) => {
            let (written, body) = confluent_header(bytes).expect("Confluent-framed");
            assert_eq!(written, id);
            body
        }
        None => bytes,
    };
    let schema = Schema::parse_str(O::OUTPUT_SCHEMA).expect("schema");
    let value = apache_avro::from_avro_datum(&schema, &mut body, None).expect("an output datum");
    assert!(body.is_empty(), "{} bytes left", body.len());
    value
}

/// An input record written as a producer would and read back as the
/// pipeline does; an output written and read back with its schema; each
/// plain and Confluent-framed, in Avro and in JSON.
fn round_trip<O>(record: O::Record<'static>, input: O::Input, output: O::Output)
where
    O: ServiceOperator,
    O::Input: PartialEq + Debug,
    for<'a> O::OutputRecord<'a>: Deserialize<'a>,
{
    let codecs = [
        (Codec::Json, None),
        (
            Codec::for_format::<O>(Format::Avro, Some(&avro(Framing::Plain, None, None))).expect("plain"),
            None,
        ),
        (
            Codec::for_format::<O>(Format::Avro, Some(&avro(Framing::Confluent, Some(7), Some(9)))).expect("confluent"),
            Some(9),
        ),
    ];
    for (codec, output_id) in &codecs {
        let mut bytes = Vec::new();
        codec.encode_input::<O>(&record, &mut bytes).expect("encodes");
        if let Codec::Avro(a) = codec {
            if a.input_framing == Framing::Confluent {
                assert_eq!(&bytes[..5], &[0, 0, 0, 0, 7], "magic byte and schema id");
            }
        }
        let mut decoded = O::empty_input();
        codec.decode::<O>(None, &bytes, &mut decoded).expect("decodes");
        assert_eq!(decoded, input);

        let (mut key, mut value) = (Vec::new(), Vec::new());
        codec.encode::<O>(&output, &mut key, &mut value).expect("encodes");
        // Records compare by their fields (the borrowed ones live shorter).
        let fields = |record: &O::OutputRecord<'_>| serde_json::to_value(record).expect("fields");
        let expected = fields(&O::to_record(&output));
        match codec {
            Codec::Avro(_) => {
                let datum = read_output::<O>(&value, *output_id);
                let back: O::OutputRecord<'_> = apache_avro::from_value(&datum).expect("an output record");
                assert_eq!(fields(&back), expected);
            }
            _ => {
                let back: O::OutputRecord<'_> = serde_json::from_slice(&value).expect("JSON output");
                assert_eq!(fields(&back), expected);
            }
        }
    }
}

fn update(key: &str, value: f64) -> KeyUpdate {
    KeyUpdate {
        key: key.as_bytes().to_vec(),
        value,
    }
}

#[test]
fn every_schema_round_trips_plain_and_confluent_framed() {
    round_trip::<WordCount>(
        TextLineRecord {
            line: "to be or not".into(),
        },
        "to be or not".to_string(),
        update("be", 3.0),
    );
    round_trip::<KeyedAggregation>(
        KeyedValueRecord {
            key: "eu".into(),
            value: -2.5,
        },
        KeyedValue {
            key: b"eu".to_vec(),
            value: -2.5,
        },
        update("eu", 7.5),
    );
    round_trip::<HeavyHitters>(
        FlowPacketRecord {
            flow: "10.0.0.1:80".into(),
            bytes: 1500,
        },
        FlowPacket {
            flow: b"10.0.0.1:80".to_vec(),
            bytes: 1500,
        },
        HeavyHitter {
            flow: b"10.0.0.1:80".to_vec(),
            estimate: 12e6,
        },
    );
    round_trip::<Grep>(
        TextLineRecord {
            line: "an error here".into(),
        },
        "an error here".to_string(),
        "an error here".to_string(),
    );
    round_trip::<Tokenize>(
        TextLineRecord { line: "to be".into() },
        "to be".to_string(),
        update("be", 1.0),
    );
    round_trip::<OnlineLogisticRegression>(
        LabeledVectorRecord {
            label: true,
            features: vec![
                FeatureRecord { index: 3, value: 0.5 },
                FeatureRecord { index: -1, value: 2.0 },
            ],
        },
        LabeledVector {
            label: true,
            features: vec![(3, 0.5), (u64::MAX, 2.0)],
        },
        Prediction {
            probability: 0.25,
            label: true,
            correct: false,
        },
    );
    let model = LocalModel {
        worker: 2,
        iteration: 7,
        items: 7_000,
        loss: 0.5,
        accuracy: 0.75,
        weights: vec![(0, 1.5), (4096, -0.25)],
    };
    round_trip::<SgdWorker>(
        LabeledVectorRecord {
            label: false,
            features: vec![FeatureRecord { index: 1, value: 1.0 }],
        },
        LabeledVector {
            label: false,
            features: vec![(1, 1.0)],
        },
        model.clone(),
    );
    round_trip::<ModelAverager>(
        SgdWorker::to_record(&model),
        model,
        GlobalModel {
            clock: 7,
            version: 21,
            workers: 3,
            items: 21_000,
            loss: 0.5,
            accuracy: 0.75,
            weights_l1: 1.75,
            weights: vec![(0, 1.5), (4096, -0.25)],
            iterations: vec![7, 8, 7],
        },
    );
    round_trip::<OnlineJoin>(
        JoinTupleRecord {
            side: "right".into(),
            id: 11,
            key: 4,
            value: 1.5,
        },
        JoinTuple {
            side: Side::Right,
            id: 11,
            key: 4,
            value: 1.5,
        },
        JoinEstimate {
            count: 100.0,
            count_ci95: 3.5,
            sum: 250.0,
            sum_ci95: 9.0,
            sampled: 42,
        },
    );
}

#[test]
fn every_shipped_schema_is_an_operators_input_or_output() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("schemas");
    let compiled = [
        schemas::TEXT_LINE,
        schemas::FLOW_PACKET,
        schemas::HEAVY_HITTER,
        schemas::KEYED_VALUE,
        schemas::LABELED_VECTOR,
        schemas::PREDICTION,
        schemas::JOIN_TUPLE,
        schemas::JOIN_ESTIMATE,
        schemas::LOCAL_MODEL,
        schemas::GLOBAL_MODEL,
    ];
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).expect("schemas/") {
        let text = std::fs::read_to_string(entry.expect("entry").path()).expect("a schema");
        assert!(compiled.contains(&text.as_str()), "a schema no operator uses:\n{text}");
        files += 1;
    }
    assert_eq!(files, compiled.len());
}

#[test]
fn text_lines_decode_and_counts_encode_as_kafka_streams_does() {
    let mut line = WordCount::empty_input();
    Codec::Text
        .decode::<WordCount>(None, b"to be or not", &mut line)
        .expect("text");
    assert_eq!(line, "to be or not");
    let error = Codec::Text
        .decode::<WordCount>(None, &[0xff, 0xfe], &mut line)
        .unwrap_err();
    assert!(error.contains("UTF-8"), "{error}");
    let (mut key, mut value) = (Vec::new(), Vec::new());
    let keyed = Codec::Text
        .encode::<WordCount>(&update("be", 3.0), &mut key, &mut value)
        .expect("text");
    assert!(keyed);
    assert_eq!((key.as_slice(), value.as_slice()), (&b"be"[..], &b"3"[..]));
    let keyed = Codec::Text
        .encode::<Grep>(&"an error".to_string(), &mut key, &mut value)
        .expect("text");
    assert!(!keyed, "grep's lines have no key");
    assert_eq!(value, b"an error");
}

#[test]
fn keyed_numbers_decode_from_a_keyed_text_record_or_from_json() {
    let mut input = KeyedAggregation::empty_input();
    let text = |key: Option<&[u8]>, value: &[u8], input: &mut KeyedValue| {
        Codec::Text.decode::<KeyedAggregation>(key, value, input)
    };
    text(Some(b"eu"), b" 2.5 ", &mut input).expect("text");
    assert_eq!((input.key.as_slice(), input.value), (&b"eu"[..], 2.5));
    text(Some(b"us"), b"", &mut input).expect("a bare key counts one");
    assert_eq!((input.key.as_slice(), input.value), (&b"us"[..], 1.0));
    let error = text(None, b"1", &mut input).unwrap_err();
    assert!(error.contains("no key"), "{error}");
    let error = text(Some(b"k"), b"ten", &mut input).unwrap_err();
    assert!(error.contains("not a number"), "{error}");
    let json = |value: &[u8], input: &mut KeyedValue| Codec::Json.decode::<KeyedAggregation>(None, value, input);
    json(br#"{"key":"eu","value":-4}"#, &mut input).expect("json");
    assert_eq!((input.key.as_slice(), input.value), (&b"eu"[..], -4.0));
    json(br#"{"key":"us"}"#, &mut input).expect("counting needs no value");
    assert_eq!((input.key.as_slice(), input.value), (&b"us"[..], 1.0));
    let error = json(br#"{"value":1}"#, &mut input).unwrap_err();
    assert!(error.contains("key"), "{error}");
}

#[test]
fn bad_records_say_why() {
    let mut packet = HeavyHitters::empty_input();
    Codec::Json
        .decode::<HeavyHitters>(None, br#"{"flow":"a\"b","bytes":1500}"#, &mut packet)
        .expect("packet");
    assert_eq!((packet.flow.as_slice(), packet.bytes), (&b"a\"b"[..], 1500));
    let json = |value: &[u8], packet: &mut FlowPacket| Codec::Json.decode::<HeavyHitters>(None, value, packet);
    assert!(json(br#"{"flow":"a"}"#, &mut packet).unwrap_err().contains("bytes"));
    assert!(json(br#"{"flow":"a","bytes":-1}"#, &mut packet)
        .unwrap_err()
        .contains("negative"));
    let mut tuple = OnlineJoin::empty_input();
    let error = Codec::Json
        .decode::<OnlineJoin>(None, br#"{"side":"up","id":1,"key":2,"value":3}"#, &mut tuple)
        .unwrap_err();
    assert!(error.contains("side"), "{error}");
    assert!(Codec::Text
        .decode::<HeavyHitters>(None, b"a 1500", &mut packet)
        .unwrap_err()
        .contains("does not read text"));

    let confluent =
        Codec::for_format::<HeavyHitters>(Format::Avro, Some(&avro(Framing::Confluent, Some(7), None))).expect("codec");
    let mut good = Vec::new();
    confluent
        .encode_input::<HeavyHitters>(
            &FlowPacketRecord {
                flow: "f".into(),
                bytes: 1,
            },
            &mut good,
        )
        .expect("encodes");
    let mut decode = |bytes: &[u8]| confluent.decode::<HeavyHitters>(None, bytes, &mut packet).unwrap_err();
    assert!(
        decode(&good[5..]).contains("magic byte"),
        "plain where framed was expected"
    );
    assert!(decode(&[0, 0, 1]).contains("too short"));
    let mut other_id = good.clone();
    other_id[4] = 8;
    assert!(decode(&other_id).contains("schema id 8"));
    let mut longer = good.clone();
    longer.push(0);
    assert!(decode(&longer).contains("1 bytes left"));
    assert!(decode(&good[..good.len() - 1]).contains("not an Avro afstream.FlowPacket"));
}

#[test]
fn inputs_written_with_an_older_or_newer_schema_are_resolved_against_the_workloads() {
    let dir = std::env::temp_dir().join(format!("afstream-codec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    // A producer's newer schema: an extra field, and bytes as an int (promoted to long).
    let newer = dir.join("flow_packet_v2.avsc");
    std::fs::write(
        &newer,
        r#"{"type": "record", "name": "FlowPacket", "namespace": "afstream", "fields": [
            {"name": "protocol", "type": "string"},
            {"name": "flow", "type": "string"},
            {"name": "bytes", "type": "int"}]}"#,
    )
    .expect("schema");
    let config = AvroConfig {
        input_schema: Some(newer),
        ..avro(Framing::Plain, None, None)
    };
    let codec = Codec::for_format::<HeavyHitters>(Format::Avro, Some(&config)).expect("compatible");
    #[derive(Serialize)]
    struct PacketV2<'a> {
        protocol: &'a str,
        flow: &'a str,
        bytes: i32,
    }
    let writer =
        Schema::parse_str(&std::fs::read_to_string(dir.join("flow_packet_v2.avsc")).expect("read")).expect("schema");
    let mut bytes = Vec::new();
    apache_avro::write_avro_datum_ref(
        &writer,
        &PacketV2 {
            protocol: "tcp",
            flow: "f",
            bytes: 60,
        },
        &mut bytes,
    )
    .expect("writes");
    let mut packet = HeavyHitters::empty_input();
    codec
        .decode::<HeavyHitters>(None, &bytes, &mut packet)
        .expect("resolved");
    assert_eq!((packet.flow.as_slice(), packet.bytes), (&b"f"[..], 60));

    let incompatible = dir.join("flow_as_long.avsc");
    std::fs::write(
        &incompatible,
        r#"{"type": "record", "name": "FlowPacket", "namespace": "afstream", "fields": [
            {"name": "flow", "type": "long"}, {"name": "bytes", "type": "long"}]}"#,
    )
    .expect("schema");
    let config = AvroConfig {
        input_schema: Some(incompatible),
        ..avro(Framing::Plain, None, None)
    };
    let error = Codec::for_format::<HeavyHitters>(Format::Avro, Some(&config))
        .err()
        .expect("incompatible");
    assert!(error.contains("pipeline.avro.input_schema"), "{error}");
    let config = AvroConfig {
        input_schema: Some(dir.join("missing.avsc")),
        ..avro(Framing::Plain, None, None)
    };
    let error = Codec::for_format::<HeavyHitters>(Format::Avro, Some(&config))
        .err()
        .expect("missing");
    assert!(error.contains("missing.avsc"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}
