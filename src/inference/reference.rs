//! `actguide dev engine-reference`: a server speaking the part of llama.cpp's
//! HTTP API the engine client uses (`GET /health`, `POST /completion`
//! with token-id prompts, a GBNF alternation grammar, `n_probs`), over an
//! actguide policy loaded from a GGUF file. It takes llama-server's
//! launch flags, so a run can launch it in llama-server's place.
//!
//! It is the engine tests' server: its log-probs are the policy's own, so
//! the trainer's recomputed log-probs must match them to float precision,
//! and it can be killed mid-run like a real server. It serves one request
//! at a time, so it bounds what one request may cost: a prompt and
//! `n_predict` past the model's positions are refused before any compute,
//! and a client that closes its connection stops its generation.

use std::io::ErrorKind;
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;

use candle_core::Device;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::api::parse_gbnf_alternation;
use crate::env::external::serve::{read_request, respond};
use crate::model::{GenerateOptions, Policy, Tok, TokenTrie};

/// llama-server's flags that the reference server reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerArgs {
    pub model: PathBuf,
    /// A llama.cpp LoRA GGUF applied on top of the model (`--lora`).
    pub lora: Option<PathBuf>,
    pub host: String,
    pub port: u16,
    pub threads: usize,
}

impl ServerArgs {
    /// Parse llama-server style flags: `-m PATH`, `--lora PATH`, `--host
    /// H`, `--port P`, `-t N`; `-np N` and `-c N` are accepted and ignored (one request at
    /// a time, contexts as long as the model's).
    pub fn parse(args: &[String]) -> Result<Self, String> {
        let mut model = None;
        let mut lora = None;
        let mut host = "127.0.0.1".to_string();
        let mut port = 8080u16;
        let mut threads = 1usize;
        let mut it = args.iter();
        while let Some(a) = it.next() {
            let mut val = || it.next().cloned().ok_or(format!("{a} needs a value"));
            match a.as_str() {
                "-m" | "--model" => model = Some(PathBuf::from(val()?)),
                "--lora" => lora = Some(PathBuf::from(val()?)),
                "--host" => host = val()?,
                "--port" => port = val()?.parse().map_err(|e| format!("--port: {e}"))?,
                "-t" | "--threads" => {
                    threads = val()?.parse().map_err(|e| format!("-t: {e}"))?;
                }
                "-np" | "--parallel" | "-c" | "--ctx-size" => {
                    val()?;
                }
                other => return Err(format!("unknown flag {other}")),
            }
        }
        Ok(ServerArgs {
            model: model.ok_or("-m MODEL.gguf is required")?,
            lora,
            host,
            port,
            threads: threads.max(1),
        })
    }
}

/// The server: a policy, its tokenizer and a bound socket.
pub struct ReferenceServer {
    listener: TcpListener,
    policy: Policy,
    tok: Tok,
    eos: u32,
}

impl ReferenceServer {
    pub fn open(a: &ServerArgs) -> Result<Self, String> {
        let mut policy = Policy::from_gguf(&a.model, &Device::Cpu).map_err(|e| e.to_string())?;
        if let Some(lora) = &a.lora {
            policy = policy.load_lora_gguf(lora).map_err(|e| e.to_string())?;
        }
        let tok = Tok::from_gguf(&a.model).map_err(|e| e.to_string())?;
        let eos = policy
            .config()
            .eos_token_id
            .ok_or("the model has no eos token")?;
        let listener = TcpListener::bind((a.host.as_str(), a.port))
            .map_err(|e| format!("binding {}:{}: {e}", a.host, a.port))?;
        Ok(ReferenceServer {
            listener,
            policy,
            tok,
            eos,
        })
    }

    /// Serve forever, one request at a time.
    pub fn run(self) {
        for stream in self.listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let Some((method, path, body)) = read_request(&mut stream) else {
                continue;
            };
            let reply = match (method.as_str(), path.as_str()) {
                ("GET", "/health") => Ok(json!({ "status": "ok" })),
                ("POST", "/completion") => self.completion(&body, &mut || client_gone(&stream)),
                _ => Err(CompletionError::Invalid(format!(
                    "no route {method} {path}"
                ))),
            };
            match reply {
                Ok(v) => respond(&mut stream, 200, &v.to_string()),
                // Nobody is left to answer; the log says why the work ended.
                Err(e @ CompletionError::ClientGone { .. }) => eprintln!("engine-reference: {e}"),
                Err(e) => respond(&mut stream, 400, &e.body().to_string()),
            }
        }
    }

    /// `POST /completion`: sample one answer for the token-id prompt.
    /// `gone` is asked between decode steps whether the client has left.
    fn completion(
        &self,
        b: &Value,
        gone: &mut dyn FnMut() -> bool,
    ) -> Result<Value, CompletionError> {
        let invalid = |m: &str| CompletionError::Invalid(m.to_string());
        let prompt: Vec<u32> = b["prompt"]
            .as_array()
            .ok_or_else(|| invalid("`prompt` must be a list of token ids"))?
            .iter()
            .map(|t| t.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| invalid("`prompt` must be a list of token ids"))?;
        let n_predict = self.n_predict(prompt.len(), b.get("n_predict"))?;
        let num = |k: &str, d: f64| b.get(k).and_then(Value::as_f64).unwrap_or(d);
        let opts = GenerateOptions {
            max_new_tokens: n_predict,
            temperature: num("temperature", 1.0),
            top_p: num("top_p", 1.0),
            greedy: false,
            eos_token_id: self.eos,
        };
        let tries = match b.get("grammar").and_then(Value::as_str) {
            Some(g) => {
                let answers = parse_gbnf_alternation(g).map_err(CompletionError::Invalid)?;
                let ids = answers
                    .iter()
                    .map(|a| self.tok.encode(a))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| CompletionError::Invalid(e.to_string()))?;
                Some(vec![TokenTrie::new(&ids, self.eos)])
            }
            None => None,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(num("seed", 0.0) as u64);
        let mut left = false;
        let g = self
            .policy
            .generate_until(&[prompt], &opts, tries.as_deref(), &mut rng, &mut || {
                left = left || gone();
                left
            })
            .map_err(|e| CompletionError::Invalid(e.to_string()))?
            .pop()
            .ok_or_else(|| invalid("no generation"))?;
        if left {
            return Err(CompletionError::ClientGone {
                generated: g.tokens.len(),
                n_predict,
            });
        }
        let probs: Vec<Value> = g
            .tokens
            .iter()
            .zip(&g.logprobs)
            .map(|(&id, &lp)| {
                json!({
                    "id": id,
                    "token": self.tok.decode(&[id]).unwrap_or_default(),
                    "logprob": lp,
                    "top_logprobs": [],
                })
            })
            .collect();
        let body: Vec<u32> = g
            .tokens
            .iter()
            .copied()
            .filter(|&t| t != self.eos)
            .collect();
        Ok(json!({
            "content": self.tok.decode(&body).unwrap_or_default(),
            "tokens": g.tokens,
            "completion_probabilities": probs,
            "stop_type": if g.finished { "eos" } else { "limit" },
            "stopped_eos": g.finished,
            "stopped_limit": !g.finished,
            "tokens_predicted": g.tokens.len(),
        }))
    }

    /// The tokens to generate after a prompt of `prompt` tokens: the
    /// request's `n_predict` (16 when absent; negative, as llama.cpp's -1:
    /// up to the model's last position). A prompt and `n_predict` past the
    /// model's positions are refused here, before any compute: the model
    /// has no rotary position for them, and one request would hold the
    /// server for minutes.
    fn n_predict(&self, prompt: usize, v: Option<&Value>) -> Result<usize, CompletionError> {
        let positions = self.policy.config().max_position_embeddings;
        let asked = match v.filter(|v| !v.is_null()) {
            None => Some(16),
            Some(v) => match v.as_f64() {
                Some(x) if x < 0.0 => None,
                // Saturates: a huge n_predict is refused below.
                Some(x) => Some(x as usize),
                None => {
                    return Err(CompletionError::Invalid(
                        "`n_predict` must be a number".into(),
                    ))
                }
            },
        };
        let n_predict = asked.unwrap_or(positions.saturating_sub(prompt));
        if prompt.saturating_add(n_predict) > positions {
            return Err(CompletionError::ExceedsContext {
                prompt,
                n_predict,
                positions,
            });
        }
        Ok(n_predict)
    }
}

/// Why a completion request gets no completion.
#[derive(Debug, thiserror::Error)]
pub enum CompletionError {
    /// A request the server cannot read or run (llama.cpp's
    /// `invalid_request_error`).
    #[error("{0}")]
    Invalid(String),
    /// The prompt and the tokens to predict need more positions than the
    /// model has (llama.cpp's `exceed_context_size_error`, whose reply
    /// carries both numbers).
    #[error(
        "request ({prompt} prompt tokens + {n_predict} to predict) exceeds the available \
         context size ({positions} tokens)"
    )]
    ExceedsContext {
        prompt: usize,
        n_predict: usize,
        positions: usize,
    },
    /// The client closed its connection while its answer was generated.
    #[error(
        "the client closed the connection; generation stopped after {generated} of at most \
         {n_predict} token(s)"
    )]
    ClientGone { generated: usize, n_predict: usize },
}

impl CompletionError {
    /// The JSON body of the 400 reply, in llama.cpp's shape.
    fn body(&self) -> Value {
        let mut e = json!({ "code": 400, "message": self.to_string() });
        match self {
            CompletionError::ExceedsContext {
                prompt, positions, ..
            } => {
                e["type"] = json!("exceed_context_size_error");
                e["n_prompt_tokens"] = json!(prompt);
                e["n_ctx"] = json!(positions);
            }
            _ => e["type"] = json!("invalid_request_error"),
        }
        json!({ "error": e })
    }
}

/// Whether the peer of `stream` has closed it: a non-blocking peek reads
/// end-of-stream (or the connection was reset). Bytes waiting, or none
/// yet, mean the client is still there.
fn client_gone(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let r = stream.peek(&mut [0u8; 1]);
    let _ = stream.set_nonblocking(false);
    match r {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_server_flags_parse() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let a = ServerArgs::parse(&s(&[
            "-m",
            "x.gguf",
            "--host",
            "127.0.0.1",
            "--port",
            "9001",
            "-t",
            "2",
            "-np",
            "4",
            "-c",
            "4096",
            "--lora",
            "a.gguf",
        ]))
        .unwrap();
        assert_eq!(a.port, 9001);
        assert_eq!(a.lora, Some(PathBuf::from("a.gguf")));
        assert_eq!(a.threads, 2);
        assert_eq!(a.model, PathBuf::from("x.gguf"));
        assert!(ServerArgs::parse(&s(&["--port", "1"]))
            .unwrap_err()
            .contains("-m"));
        assert!(ServerArgs::parse(&s(&["-m", "x", "--flash"]))
            .unwrap_err()
            .contains("--flash"));
        assert!(ServerArgs::parse(&s(&["-m"]))
            .unwrap_err()
            .contains("value"));
    }
}
