//! From Kafka records to operator inputs and from operator outputs to records.
//!
//! Decoding writes into an input the task reuses, so the hot path does not
//! allocate per item once its buffers have grown.

use std::borrow::Cow;
use std::io::Write as _;

use serde::Deserialize;

use super::config::Format;
use crate::core::{CoreError, KeyStore, Operator};
use crate::operators::heavy_hitters::{FlowPacket, HeavyHitter, HeavyHitterConfig, HeavyHitters};
use crate::operators::keyed_aggregation::{KeyUpdate, KeyedAggregation, KeyedAggregationConfig, KeyedValue};
use crate::operators::word_count::{WordCount, WordCountConfig};

/// An operator the service can run: how it is built, how a record becomes its
/// input and how its output becomes a record.
pub trait ServiceOperator: Operator + Sized {
    type Config: Clone;

    /// Whether the operator keeps its keyed state in a local store when the
    /// pipeline has a state directory (small states stay in memory and recover
    /// from the changelog).
    const STORE_BACKED: bool;

    /// Builds the operator, its keyed state in `store` (with about
    /// `resident_keys` clean keys in memory) when one is given.
    fn build(config: &Self::Config, store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError>;

    /// An input to decode into.
    fn empty_input() -> Self::Input;

    /// Decodes a record's value into `input`; the error says why it does not decode.
    fn decode(value: &[u8], input: &mut Self::Input) -> Result<(), String>;

    /// Decodes a whole record in the pipeline's format; by default its value
    /// alone (the config allows one format per operator).
    fn decode_record(format: Format, key: Option<&[u8]>, value: &[u8], input: &mut Self::Input) -> Result<(), String> {
        let _ = (format, key);
        Self::decode(value, input)
    }

    /// Encodes an output's key and value (both cleared first).
    fn encode(output: &Self::Output, key: &mut Vec<u8>, value: &mut Vec<u8>);
}

impl ServiceOperator for WordCount {
    type Config = WordCountConfig;
    const STORE_BACKED: bool = true;

    fn build(config: &WordCountConfig, store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        match store {
            Some((store, resident_keys)) => WordCount::with_store(*config, store, resident_keys),
            None => WordCount::new(*config),
        }
    }

    fn empty_input() -> String {
        String::new()
    }

    fn decode(value: &[u8], line: &mut String) -> Result<(), String> {
        let text = std::str::from_utf8(value).map_err(|e| format!("not UTF-8 text: {e}"))?;
        line.clear();
        line.push_str(text);
        Ok(())
    }

    /// Kafka Streams' convention: the word is the key, its new count the value.
    fn encode(update: &KeyUpdate, key: &mut Vec<u8>, value: &mut Vec<u8>) {
        encode_key_update(update, key, value);
    }
}

/// The key, and its new aggregate as text.
fn encode_key_update(update: &KeyUpdate, key: &mut Vec<u8>, value: &mut Vec<u8>) {
    key.clear();
    key.extend_from_slice(&update.key);
    value.clear();
    let _ = write!(value, "{}", update.value);
}

/// A keyed number in JSON: `{"key": "…", "value": 2.5}` (the value may be
/// left out when counting).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyedRecord<'a> {
    #[serde(borrow)]
    key: Cow<'a, str>,
    #[serde(default)]
    value: Option<f64>,
}

impl ServiceOperator for KeyedAggregation {
    type Config = KeyedAggregationConfig;
    const STORE_BACKED: bool = true;

    fn build(config: &KeyedAggregationConfig, store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        match store {
            Some((store, resident_keys)) => KeyedAggregation::with_store(*config, store, resident_keys),
            None => KeyedAggregation::new(*config),
        }
    }

    fn empty_input() -> KeyedValue {
        KeyedValue {
            key: Vec::new(),
            value: 0.0,
        }
    }

    /// JSON: `{"key": "…", "value": N}`.
    fn decode(value: &[u8], input: &mut KeyedValue) -> Result<(), String> {
        let record: KeyedRecord<'_> =
            serde_json::from_slice(value).map_err(|e| format!("not {{\"key\": …, \"value\": …}}: {e}"))?;
        input.key.clear();
        input.key.extend_from_slice(record.key.as_bytes());
        input.value = record.value.unwrap_or(1.0);
        Ok(())
    }

    /// Text: the record's key is the key and its value a decimal number (any
    /// value, even none, when counting: only the key matters then).
    fn decode_record(format: Format, key: Option<&[u8]>, value: &[u8], input: &mut KeyedValue) -> Result<(), String> {
        match format {
            Format::Json => Self::decode(value, input),
            Format::Text => {
                let key = key.ok_or("the record has no key to aggregate by")?;
                let text = std::str::from_utf8(value).map_err(|e| format!("not UTF-8 text: {e}"))?;
                input.value = match text.trim() {
                    "" => 1.0,
                    number => number
                        .parse()
                        .map_err(|e| format!("value {number:?} is not a number: {e}"))?,
                };
                input.key.clear();
                input.key.extend_from_slice(key);
                Ok(())
            }
        }
    }

    /// The key, and its new count or sum as text.
    fn encode(update: &KeyUpdate, key: &mut Vec<u8>, value: &mut Vec<u8>) {
        encode_key_update(update, key, value);
    }
}

/// A packet as users produce it: `{"flow": "…", "bytes": 1500}`.
#[derive(Deserialize)]
struct PacketRecord<'a> {
    #[serde(borrow)]
    flow: Cow<'a, str>,
    bytes: u64,
}

impl ServiceOperator for HeavyHitters {
    type Config = HeavyHitterConfig;
    /// A Count-Min sketch and a few hundred candidates: small, in memory.
    const STORE_BACKED: bool = false;

    fn build(config: &HeavyHitterConfig, _store: Option<(Box<dyn KeyStore>, usize)>) -> Result<Self, CoreError> {
        HeavyHitters::new(*config)
    }

    fn empty_input() -> FlowPacket {
        FlowPacket {
            flow: Vec::new(),
            bytes: 0,
        }
    }

    fn decode(value: &[u8], packet: &mut FlowPacket) -> Result<(), String> {
        let record: PacketRecord<'_> =
            serde_json::from_slice(value).map_err(|e| format!("not a packet {{\"flow\": …, \"bytes\": …}}: {e}"))?;
        packet.flow.clear();
        packet.flow.extend_from_slice(record.flow.as_bytes());
        packet.bytes = record.bytes;
        Ok(())
    }

    /// Keyed by flow; the value is `{"flow": "…", "estimate": bytes}`.
    fn encode(hitter: &HeavyHitter, key: &mut Vec<u8>, value: &mut Vec<u8>) {
        key.clear();
        key.extend_from_slice(&hitter.flow);
        value.clear();
        let flow = String::from_utf8_lossy(&hitter.flow);
        let _ = serde_json::to_writer(
            &mut *value,
            &serde_json::json!({ "flow": flow, "estimate": hitter.estimate }),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lines_decode_and_counts_encode_as_kafka_streams_does() {
        let mut line = WordCount::empty_input();
        WordCount::decode(b"to be or not", &mut line).expect("text");
        assert_eq!(line, "to be or not");
        assert!(WordCount::decode(&[0xff, 0xfe], &mut line)
            .unwrap_err()
            .contains("UTF-8"));
        let (mut key, mut value) = (Vec::new(), Vec::new());
        WordCount::encode(
            &KeyUpdate {
                key: b"be".to_vec(),
                value: 3.0,
            },
            &mut key,
            &mut value,
        );
        assert_eq!((key.as_slice(), value.as_slice()), (&b"be"[..], &b"3"[..]));
    }

    #[test]
    fn keyed_numbers_decode_from_a_keyed_text_record_or_from_json() {
        let mut input = KeyedAggregation::empty_input();
        KeyedAggregation::decode_record(Format::Text, Some(b"eu"), b" 2.5 ", &mut input).expect("text");
        assert_eq!((input.key.as_slice(), input.value), (&b"eu"[..], 2.5));
        KeyedAggregation::decode_record(Format::Text, Some(b"us"), b"", &mut input).expect("a bare key counts one");
        assert_eq!((input.key.as_slice(), input.value), (&b"us"[..], 1.0));
        let error = KeyedAggregation::decode_record(Format::Text, None, b"1", &mut input).unwrap_err();
        assert!(error.contains("no key"), "{error}");
        let error = KeyedAggregation::decode_record(Format::Text, Some(b"k"), b"ten", &mut input).unwrap_err();
        assert!(error.contains("not a number"), "{error}");
        KeyedAggregation::decode_record(Format::Json, None, br#"{"key":"eu","value":-4}"#, &mut input).expect("json");
        assert_eq!((input.key.as_slice(), input.value), (&b"eu"[..], -4.0));
        let error = KeyedAggregation::decode_record(Format::Json, None, br#"{"value":1}"#, &mut input).unwrap_err();
        assert!(error.contains("key"), "{error}");
    }

    #[test]
    fn packets_decode_from_json_and_bad_ones_say_why() {
        let mut packet = HeavyHitters::empty_input();
        HeavyHitters::decode(br#"{"flow":"a\"b","bytes":1500}"#, &mut packet).expect("packet");
        assert_eq!((packet.flow.as_slice(), packet.bytes), (&b"a\"b"[..], 1500));
        let error = HeavyHitters::decode(br#"{"flow":"a"}"#, &mut packet).unwrap_err();
        assert!(error.contains("bytes"), "{error}");
    }
}
