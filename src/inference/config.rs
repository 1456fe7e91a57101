//! `rollout.engine`: where rollouts are generated.

use serde::{Deserialize, Deserializer, Serialize};

use super::api::Api;

/// An engine section: `"builtin"` (the default: candle generation in this
/// process) or a map of engine servers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    /// `"openai"`: OpenAI-style HTTP servers (the only kind besides
    /// `"builtin"`, which is written as the plain string).
    pub kind: EngineKind,
    /// The server API: "llama.cpp", "vllm" or "sglang".
    pub api: Api,
    /// Base URLs of running servers (`http://host:port`). Empty when
    /// `launch` starts them.
    #[serde(default)]
    pub servers: Vec<String>,
    /// llama.cpp servers this run starts (and restarts with new weights
    /// after each optimiser step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<LaunchSection>,
    /// The served base model's name (vLLM's `model`); adapters synced
    /// after each step are named `<model>-v<N>` (vLLM, SGLang).
    #[serde(default)]
    pub model: String,
    /// Seconds one request may take before its server counts as down.
    #[serde(default = "d_timeout")]
    pub timeout_s: f64,
    /// Requests in flight per server.
    #[serde(default = "d_concurrency")]
    pub max_concurrency: usize,
    /// Seconds a failed server is left alone before it is tried again;
    /// doubles on each further failure, up to 60.
    #[serde(default = "d_retry")]
    pub retry_s: f64,
    /// The truncated importance weight's cap C: a token's loss is
    /// weighted by min(π_old / π_engine, C), π_old the trainer's own
    /// log-prob of the token before the update, π_engine the engine's.
    #[serde(default = "d_tis_cap")]
    pub tis_cap: f64,
}

/// `rollout.engine.kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Openai,
}

/// `rollout.engine.launch`: llama.cpp servers started by the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaunchSection {
    /// The `llama-server` program (scripts/build-llama-server.sh builds
    /// one).
    pub program: String,
    /// How many servers (each on its own loopback port).
    #[serde(default = "d_one")]
    pub count: usize,
    /// Threads per server (`-t`).
    #[serde(default = "d_one")]
    pub threads: usize,
    /// Further arguments, appended as given.
    #[serde(default)]
    pub args: Vec<String>,
    /// For a LoRA policy: restart the servers on the same base GGUF with
    /// the step's adapter as a llama.cpp LoRA GGUF (`--lora`, a few MB)
    /// instead of a merged model written each step. `false` writes the
    /// merged model (what llama.cpp builds without LoRA support need).
    #[serde(default = "d_true")]
    pub adapter: bool,
}

fn d_timeout() -> f64 {
    120.0
}
fn d_concurrency() -> usize {
    8
}
fn d_retry() -> f64 {
    2.0
}
fn d_tis_cap() -> f64 {
    2.0
}
fn d_one() -> usize {
    1
}
fn d_true() -> bool {
    true
}

impl EngineSection {
    /// The checks serde cannot express.
    pub fn check(&self) -> Result<(), String> {
        if self.servers.is_empty() == self.launch.is_none() {
            return Err(
                "rollout.engine needs either `servers` (running servers) or `launch` (servers this run starts), not both"
                    .into(),
            );
        }
        if let Some(l) = &self.launch {
            if self.api != Api::LlamaCpp {
                return Err(
                    "rollout.engine.launch starts llama.cpp servers only (api: \"llama.cpp\")"
                        .into(),
                );
            }
            if l.count == 0 || l.threads == 0 {
                return Err("rollout.engine.launch.count and .threads must be ≥ 1".into());
            }
        }
        for s in &self.servers {
            if !(s.starts_with("http://") || s.starts_with("https://")) {
                return Err(format!(
                    "rollout.engine.servers: {s:?} is not an http:// or https:// URL"
                ));
            }
        }
        let ok = self.timeout_s > 0.0 && self.retry_s > 0.0 && self.tis_cap >= 1.0;
        if !ok || self.max_concurrency == 0 {
            return Err(
                "rollout.engine: timeout_s and retry_s must be > 0, max_concurrency ≥ 1 and tis_cap ≥ 1"
                    .into(),
            );
        }
        Ok(())
    }
}

/// `rollout.engine`: `"builtin"` or an engine map (absent = builtin).
pub fn engine_field<'de, D: Deserializer<'de>>(d: D) -> Result<Option<EngineSection>, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    match v {
        serde_json::Value::String(s) if s == "builtin" => Ok(None),
        serde_json::Value::String(s) => Err(serde::de::Error::custom(format!(
            "unknown engine {s:?}: expected \"builtin\" or a map with kind: \"openai\""
        ))),
        v => serde_json::from_value::<EngineSection>(v)
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<Option<EngineSection>, String> {
        engine_field(v).map_err(|e| e.to_string())
    }

    #[test]
    fn builtin_and_engine_maps_parse() {
        assert_eq!(parse(serde_json::json!("builtin")).unwrap(), None);
        let e = parse(serde_json::json!({
            "kind": "openai", "api": "llama.cpp", "servers": ["http://127.0.0.1:8080"]
        }))
        .unwrap()
        .unwrap();
        assert_eq!(e.api, Api::LlamaCpp);
        assert_eq!(e.max_concurrency, 8);
        assert!(e.check().is_ok());
    }

    #[test]
    fn bad_engine_settings_say_what_is_wrong() {
        assert!(parse(serde_json::json!("vllm"))
            .unwrap_err()
            .contains("builtin"));
        let e = parse(serde_json::json!({"kind": "openai", "api": "tgi", "servers": []}));
        assert!(e.unwrap_err().contains("tgi"), "names the bad value");
        let e = parse(serde_json::json!({"kind": "openai", "api": "vllm", "servrs": []}));
        assert!(e.unwrap_err().contains("servrs"));
        let none = parse(serde_json::json!({"kind": "openai", "api": "vllm"}))
            .unwrap()
            .unwrap();
        assert!(none.check().unwrap_err().contains("servers"));
        let bad_url =
            parse(serde_json::json!({"kind": "openai", "api": "vllm", "servers": ["localhost:1"]}))
                .unwrap()
                .unwrap();
        assert!(bad_url.check().unwrap_err().contains("localhost:1"));
        let launch_vllm = parse(serde_json::json!({
            "kind": "openai", "api": "vllm", "launch": {"program": "x"}
        }))
        .unwrap()
        .unwrap();
        assert!(launch_vllm.check().unwrap_err().contains("llama.cpp"));
    }
}
