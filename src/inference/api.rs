//! What each engine server speaks: the generation request's body and
//! route, how its reply becomes tokens and log-probs, and how constrained
//! decoding to the admissible actions maps onto what the engine offers.
//!
//! | API | route | prompt | constraint | behaviour log-probs |
//! |---|---|---|---|---|
//! | llama.cpp | `POST /completion` | `prompt`: token ids | `grammar` (GBNF alternation) | `n_probs: 1`: `completion_probabilities[i].logprob` (raw logits, before the sampler chain) |
//! | vLLM | `POST /v1/completions` | `prompt`: token ids | `structured_outputs.choice` | `logprobs: 0` + `return_tokens_as_token_ids`: `choices[0].logprobs.{tokens, token_logprobs}` |
//! | SGLang | `POST /generate` | `input_ids` | `sampling_params.regex` | `return_logprob`: `meta_info.output_token_logprobs` `[[logprob, id, null], …]` |
//!
//! All three report the sampled tokens' log-probs of the model's raw
//! distribution (temperature 1, no top-p, no constraint mask), which is
//! what [`crate::model::Policy::score`] computes for the same tokens at
//! temperature 1; so an engine run samples at temperature 1 (checked when
//! the experiment loads).

use serde_json::{json, Value};

use super::EngineReply;
use crate::env::external::short;

/// The engine server API (`rollout.engine.api`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Api {
    #[serde(rename = "llama.cpp")]
    LlamaCpp,
    #[serde(rename = "vllm")]
    Vllm,
    #[serde(rename = "sglang")]
    Sglang,
}

/// One generation request, whatever the API.
#[derive(Debug, Clone, PartialEq)]
pub struct Request<'a> {
    pub prompt: &'a [u32],
    /// The answers allowed (each a complete answer text, without the stop
    /// token); `None` samples freely.
    pub answers: Option<&'a [String]>,
    pub max_new_tokens: usize,
    pub temperature: f64,
    pub top_p: f64,
    /// Ends an answer (eos or the chat template's end-of-turn token).
    pub stop: u32,
    pub seed: u64,
    /// The served model or adapter name (vLLM's `model`, SGLang's
    /// `lora_path`); empty: the server's default.
    pub model: &'a str,
}

impl Api {
    /// The generation route.
    pub fn route(self) -> &'static str {
        match self {
            Api::LlamaCpp => "/completion",
            Api::Vllm => "/v1/completions",
            Api::Sglang => "/generate",
        }
    }

    /// The readiness route (200 when the model is loaded).
    pub fn health_route(self) -> &'static str {
        "/health"
    }

    /// The JSON body of `r`.
    pub fn body(self, r: &Request<'_>) -> Value {
        match self {
            Api::LlamaCpp => {
                let mut b = json!({
                    "prompt": r.prompt,
                    "n_predict": r.max_new_tokens,
                    "temperature": r.temperature,
                    "top_p": r.top_p,
                    // Only temperature and top-p, as the built-in sampler:
                    // llama.cpp's defaults add top-k 40 and min-p 0.05.
                    "top_k": 0,
                    "min_p": 0.0,
                    "typical_p": 1.0,
                    "repeat_penalty": 1.0,
                    "seed": r.seed as u32,
                    "n_probs": 1,
                    "post_sampling_probs": false,
                    "return_tokens": true,
                    "cache_prompt": true,
                    "stream": false,
                });
                if let Some(a) = r.answers {
                    b["grammar"] = Value::String(gbnf_alternation(a));
                }
                b
            }
            Api::Vllm => {
                let mut b = json!({
                    "model": r.model,
                    "prompt": r.prompt,
                    "max_tokens": r.max_new_tokens,
                    "temperature": r.temperature,
                    "top_p": r.top_p,
                    "seed": r.seed as u32,
                    "n": 1,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": true,
                    "return_token_ids": true,
                    "stop_token_ids": [r.stop],
                    "skip_special_tokens": false,
                    "include_stop_str_in_output": true,
                });
                if let Some(a) = r.answers {
                    b["structured_outputs"] = json!({ "choice": a });
                }
                b
            }
            Api::Sglang => {
                let mut sp = json!({
                    "max_new_tokens": r.max_new_tokens,
                    "temperature": r.temperature,
                    "top_p": r.top_p,
                    "stop_token_ids": [r.stop],
                    "skip_special_tokens": false,
                    "sampling_seed": r.seed as u32,
                });
                if let Some(a) = r.answers {
                    sp["regex"] = Value::String(regex_alternation(a));
                }
                let mut b = json!({
                    "input_ids": r.prompt,
                    "sampling_params": sp,
                    "return_logprob": true,
                    "logprob_start_len": -1,
                });
                if !r.model.is_empty() {
                    b["lora_path"] = Value::String(r.model.to_string());
                }
                b
            }
        }
    }

    /// The generated tokens and their log-probs in a reply `v`. An answer
    /// that ended with the stop token carries it as its last token (with
    /// its log-prob where the engine reports one, else NaN: no behaviour
    /// log-prob).
    pub fn parse(self, v: &Value, stop: u32) -> Result<EngineReply, String> {
        let mut reply = match self {
            Api::LlamaCpp => parse_llamacpp(v)?,
            Api::Vllm => parse_vllm(v)?,
            Api::Sglang => parse_sglang(v)?,
        };
        if reply.tokens.len() != reply.logprobs.len() {
            return Err(format!(
                "{} tokens but {} log-probs",
                reply.tokens.len(),
                reply.logprobs.len()
            ));
        }
        // An engine may leave the matched stop token out of the tokens.
        if reply.finished && reply.tokens.last() != Some(&stop) {
            reply.tokens.push(stop);
            reply.logprobs.push(f32::NAN);
        }
        Ok(reply)
    }
}

fn field<'v>(v: &'v Value, key: &str) -> Result<&'v Value, String> {
    v.get(key)
        .ok_or_else(|| format!("reply has no `{key}`: {}", short(v)))
}

fn token_id(v: &Value) -> Result<u32, String> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| format!("not a token id: {v}"))
}

fn logprob(v: &Value) -> Result<f32, String> {
    v.as_f64()
        .map(|x| x as f32)
        .ok_or_else(|| format!("not a log-prob: {v}"))
}

/// llama.cpp: `completion_probabilities[i] = {id, logprob, …}` per
/// generated token (the stop token included), `stop_type` "eos" when the
/// answer ended.
fn parse_llamacpp(v: &Value) -> Result<EngineReply, String> {
    let probs = field(v, "completion_probabilities")?
        .as_array()
        .ok_or("`completion_probabilities` is not a list")?;
    let mut tokens = Vec::with_capacity(probs.len());
    let mut logprobs = Vec::with_capacity(probs.len());
    for p in probs {
        tokens.push(token_id(field(p, "id")?)?);
        logprobs.push(logprob(field(p, "logprob")?)?);
    }
    if let Some(ids) = v.get("tokens").and_then(Value::as_array) {
        let ids: Vec<u32> = ids.iter().map(token_id).collect::<Result<_, _>>()?;
        if ids != tokens {
            return Err("`tokens` and `completion_probabilities` disagree".into());
        }
    }
    let finished = match v.get("stop_type").and_then(Value::as_str) {
        Some(s) => s == "eos" || s == "word",
        None => v
            .get("stopped_eos")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    Ok(EngineReply {
        tokens,
        logprobs,
        finished,
        version: 0,
    })
}

/// vLLM: `choices[0].logprobs.tokens` as `"token_id:N"` (with
/// `return_tokens_as_token_ids`), `token_logprobs` alongside;
/// `finish_reason` "stop" when a stop token ended it.
fn parse_vllm(v: &Value) -> Result<EngineReply, String> {
    let c = field(v, "choices")?
        .get(0)
        .ok_or_else(|| format!("reply has no choice: {}", short(v)))?;
    let lp = field(c, "logprobs")?;
    let toks = field(lp, "tokens")?
        .as_array()
        .ok_or("`logprobs.tokens` is not a list")?;
    let tokens = toks
        .iter()
        .map(|t| {
            t.as_str()
                .and_then(|s| s.strip_prefix("token_id:"))
                .and_then(|s| s.parse::<u32>().ok())
                .ok_or_else(|| format!("not a `token_id:N` token: {t}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let logprobs = field(lp, "token_logprobs")?
        .as_array()
        .ok_or("`logprobs.token_logprobs` is not a list")?
        .iter()
        .map(logprob)
        .collect::<Result<Vec<_>, _>>()?;
    // `token_ids` (with `return_token_ids`, vLLM ≥ 0.10.2) must agree.
    if let Some(ids) = c.get("token_ids").and_then(Value::as_array) {
        let ids: Vec<u32> = ids.iter().map(token_id).collect::<Result<_, _>>()?;
        if ids != tokens {
            return Err("`token_ids` and `logprobs.tokens` disagree".into());
        }
    }
    let finished = c.get("finish_reason").and_then(Value::as_str) == Some("stop");
    Ok(EngineReply {
        tokens,
        logprobs,
        finished,
        version: 0,
    })
}

/// SGLang: `meta_info.output_token_logprobs = [[logprob, id, text|null],
/// …]`, `meta_info.finish_reason.type` "stop" when it ended.
fn parse_sglang(v: &Value) -> Result<EngineReply, String> {
    let v = match v.as_array() {
        Some(a) => a.first().ok_or("reply is an empty list")?,
        None => v,
    };
    let meta = field(v, "meta_info")?;
    let rows = field(meta, "output_token_logprobs")?
        .as_array()
        .ok_or("`output_token_logprobs` is not a list")?;
    let mut tokens = Vec::with_capacity(rows.len());
    let mut logprobs = Vec::with_capacity(rows.len());
    for r in rows {
        let r = r
            .as_array()
            .filter(|r| r.len() >= 2)
            .ok_or_else(|| format!("not a [logprob, id, …] row: {r}"))?;
        logprobs.push(logprob(&r[0])?);
        tokens.push(token_id(&r[1])?);
    }
    let finished = meta
        .get("finish_reason")
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str)
        == Some("stop");
    Ok(EngineReply {
        tokens,
        logprobs,
        finished,
        version: 0,
    })
}

/// A GBNF grammar whose language is exactly `answers`:
/// `root ::= "a" | "b" | …` (llama.cpp: after it, only end-of-generation
/// tokens are allowed, so the answer ends at the stop token).
pub fn gbnf_alternation(answers: &[String]) -> String {
    let alts: Vec<String> = answers
        .iter()
        .map(|a| {
            let mut s = String::with_capacity(a.len() + 2);
            s.push('"');
            for c in a.chars() {
                match c {
                    '"' => s.push_str("\\\""),
                    '\\' => s.push_str("\\\\"),
                    '\n' => s.push_str("\\n"),
                    '\r' => s.push_str("\\r"),
                    '\t' => s.push_str("\\t"),
                    c => s.push(c),
                }
            }
            s.push('"');
            s
        })
        .collect();
    format!("root ::= {}", alts.join(" | "))
}

/// The strings of a grammar written by [`gbnf_alternation`] (the
/// reference server reads its requests with it).
pub fn parse_gbnf_alternation(g: &str) -> Result<Vec<String>, String> {
    let rest = g
        .trim()
        .strip_prefix("root")
        .map(str::trim_start)
        .and_then(|r| r.strip_prefix("::="))
        .ok_or("not a `root ::= …` grammar")?;
    let mut out = Vec::new();
    let mut chars = rest.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        match chars.next() {
            None => break,
            Some('|') if !out.is_empty() => continue,
            Some('"') => {}
            Some(c) => return Err(format!("unexpected `{c}` in the grammar")),
        }
        let mut s = String::new();
        loop {
            match chars.next() {
                None => return Err("unterminated string in the grammar".into()),
                Some('"') => break,
                Some('\\') => match chars.next() {
                    Some('n') => s.push('\n'),
                    Some('r') => s.push('\r'),
                    Some('t') => s.push('\t'),
                    Some(c @ ('"' | '\\')) => s.push(c),
                    c => return Err(format!("unknown escape \\{c:?} in the grammar")),
                },
                Some(c) => s.push(c),
            }
        }
        out.push(s);
    }
    if out.is_empty() {
        return Err("the grammar allows nothing".into());
    }
    Ok(out)
}

/// A regular expression matching exactly `answers` (SGLang's `regex`).
pub fn regex_alternation(answers: &[String]) -> String {
    let alts: Vec<String> = answers
        .iter()
        .map(|a| {
            let mut s = String::with_capacity(a.len());
            for c in a.chars() {
                if "\\.^$|?*+()[]{}/".contains(c) {
                    s.push('\\');
                }
                match c {
                    '\n' => s.push_str("\\n"),
                    c => s.push(c),
                }
            }
            s
        })
        .collect();
    format!("({})", alts.join("|"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answers() -> Vec<String> {
        vec![
            "go to \"shelf\" 1".into(),
            "open a\\b".into(),
            "<action>take (x)</action>\nok".into(),
        ]
    }

    #[test]
    fn gbnf_round_trips_and_escapes() {
        let g = gbnf_alternation(&answers());
        assert_eq!(
            g,
            r#"root ::= "go to \"shelf\" 1" | "open a\\b" | "<action>take (x)</action>\nok""#
        );
        assert_eq!(parse_gbnf_alternation(&g).unwrap(), answers());
        assert!(parse_gbnf_alternation("root ::= ").is_err());
        assert!(parse_gbnf_alternation("root ::= \"a\" | b").is_err());
        assert!(parse_gbnf_alternation("x ::= \"a\"").is_err());
    }

    #[test]
    fn regex_escapes_metacharacters() {
        assert_eq!(
            regex_alternation(&answers()),
            r#"(go to "shelf" 1|open a\\b|<action>take \(x\)<\/action>\nok)"#
        );
    }

    #[test]
    fn llamacpp_reply_keeps_the_stop_token() {
        let v = json!({
            "content": "go",
            "tokens": [5, 7, 2],
            "completion_probabilities": [
                {"id": 5, "token": "go", "logprob": -0.5, "top_logprobs": []},
                {"id": 7, "token": " to", "logprob": -1.25, "top_logprobs": []},
                {"id": 2, "token": "</s>", "logprob": -0.125, "top_logprobs": []}
            ],
            "stop_type": "eos",
        });
        let r = Api::LlamaCpp.parse(&v, 2).unwrap();
        assert_eq!(r.tokens, vec![5, 7, 2]);
        assert_eq!(r.logprobs, vec![-0.5, -1.25, -0.125]);
        assert!(r.finished);
        // Cut by n_predict: not finished, no stop token added.
        let mut v2 = v.clone();
        v2["stop_type"] = json!("limit");
        let r = Api::LlamaCpp.parse(&v2, 9).unwrap();
        assert!(!r.finished && r.tokens == vec![5, 7, 2]);
        // Disagreeing token lists are refused.
        let mut v3 = v;
        v3["tokens"] = json!([5, 8, 2]);
        assert!(Api::LlamaCpp
            .parse(&v3, 2)
            .unwrap_err()
            .contains("disagree"));
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        for api in [Api::LlamaCpp, Api::Vllm, Api::Sglang] {
            for v in [
                json!(null),
                json!({}),
                json!([]),
                json!({"completion_probabilities": [{"id": -1, "logprob": 0}]}),
                json!({"choices": [{"logprobs": {"tokens": ["x"], "token_logprobs": [0]}}]}),
                json!({"meta_info": {"output_token_logprobs": [[0.0]]}}),
            ] {
                assert!(api.parse(&v, 2).is_err(), "{api:?} {v}");
            }
        }
    }

    #[test]
    fn request_bodies_carry_the_prompt_ids_and_the_constraint() {
        let a = answers();
        let r = Request {
            prompt: &[1, 2, 3],
            answers: Some(&a),
            max_new_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            stop: 2,
            seed: 7,
            model: "actguide-v3",
        };
        let b = Api::LlamaCpp.body(&r);
        assert_eq!(b["prompt"], json!([1, 2, 3]));
        assert_eq!(b["n_probs"], json!(1));
        assert_eq!(b["top_k"], json!(0));
        assert!(b["grammar"].as_str().unwrap().starts_with("root ::= "));
        let b = Api::Vllm.body(&r);
        assert_eq!(b["model"], json!("actguide-v3"));
        assert_eq!(b["structured_outputs"]["choice"], json!(a));
        assert_eq!(b["stop_token_ids"], json!([2]));
        let b = Api::Sglang.body(&r);
        assert_eq!(b["input_ids"], json!([1, 2, 3]));
        assert_eq!(b["lora_path"], json!("actguide-v3"));
        assert!(b["sampling_params"]["regex"]
            .as_str()
            .unwrap()
            .starts_with('('));
        let free = Request { answers: None, ..r };
        assert!(Api::LlamaCpp.body(&free).get("grammar").is_none());
    }
}
