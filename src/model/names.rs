//! The checkpoint names of every weight of the policy, stated once.
//!
//! HF (`transformers`) names are what [`crate::model::Policy`] uses
//! internally and what `model.safetensors` holds; GGUF (llama.cpp) names
//! are what [`crate::model::gguf`] reads and writes; LoRA adapters
//! ([`crate::model::lora`]) hang PEFT names off the projections' module
//! paths. Everything that needs a tensor's name asks this table, so the
//! layouts cannot drift apart.

/// HF name of the token embedding (also the LM head when tied).
pub const EMBED: &str = "model.embed_tokens.weight";
/// HF name of the final RMSNorm weight.
pub const NORM: &str = "model.norm.weight";
/// HF name of the untied LM head.
pub const LM_HEAD: &str = "lm_head.weight";

/// GGUF name of the token embedding.
pub const GGUF_EMBED: &str = "token_embd.weight";
/// GGUF name of the untied LM head.
pub const GGUF_LM_HEAD: &str = "output.weight";

/// Top-level tensors: (HF name, GGUF name).
pub const TOP: [(&str, &str); 3] = [
    (EMBED, GGUF_EMBED),
    (NORM, "output_norm.weight"),
    (LM_HEAD, GGUF_LM_HEAD),
];

/// GGUF prefix of the blocks' tensors (`blk.<i>.…`).
pub const GGUF_BLOCKS: &str = "blk";

/// HF prefix of the decoder layers' tensors (`model.layers.<i>.…`).
const LAYERS: &str = "model.layers";

/// Prefix of every HF tensor of decoder layer `layer` (no trailing dot).
pub fn layer_prefix(layer: usize) -> String {
    format!("{LAYERS}.{layer}")
}

/// One tensor of a decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerTensor {
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    OBias,
    QNorm,
    KNorm,
    Gate,
    Up,
    Down,
    /// RMSNorm before attention.
    Ln1,
    /// RMSNorm before the MLP.
    Ln2,
}

impl LayerTensor {
    pub const ALL: [LayerTensor; 15] = [
        LayerTensor::Q,
        LayerTensor::K,
        LayerTensor::V,
        LayerTensor::O,
        LayerTensor::QBias,
        LayerTensor::KBias,
        LayerTensor::VBias,
        LayerTensor::OBias,
        LayerTensor::QNorm,
        LayerTensor::KNorm,
        LayerTensor::Gate,
        LayerTensor::Up,
        LayerTensor::Down,
        LayerTensor::Ln1,
        LayerTensor::Ln2,
    ];

    /// (HF name below `model.layers.<i>.`, GGUF name below `blk.<i>.`).
    fn names(self) -> (&'static str, &'static str) {
        match self {
            LayerTensor::Q => ("self_attn.q_proj.weight", "attn_q.weight"),
            LayerTensor::K => ("self_attn.k_proj.weight", "attn_k.weight"),
            LayerTensor::V => ("self_attn.v_proj.weight", "attn_v.weight"),
            LayerTensor::O => ("self_attn.o_proj.weight", "attn_output.weight"),
            LayerTensor::QBias => ("self_attn.q_proj.bias", "attn_q.bias"),
            LayerTensor::KBias => ("self_attn.k_proj.bias", "attn_k.bias"),
            LayerTensor::VBias => ("self_attn.v_proj.bias", "attn_v.bias"),
            LayerTensor::OBias => ("self_attn.o_proj.bias", "attn_output.bias"),
            LayerTensor::QNorm => ("self_attn.q_norm.weight", "attn_q_norm.weight"),
            LayerTensor::KNorm => ("self_attn.k_norm.weight", "attn_k_norm.weight"),
            LayerTensor::Gate => ("mlp.gate_proj.weight", "ffn_gate.weight"),
            LayerTensor::Up => ("mlp.up_proj.weight", "ffn_up.weight"),
            LayerTensor::Down => ("mlp.down_proj.weight", "ffn_down.weight"),
            LayerTensor::Ln1 => ("input_layernorm.weight", "attn_norm.weight"),
            LayerTensor::Ln2 => ("post_attention_layernorm.weight", "ffn_norm.weight"),
        }
    }

    /// HF name below `model.layers.<i>.`.
    pub fn hf(self) -> &'static str {
        self.names().0
    }

    /// GGUF name below `blk.<i>.`.
    pub fn gguf(self) -> &'static str {
        self.names().1
    }

    /// Full HF name in layer `layer`.
    pub fn name(self, layer: usize) -> String {
        format!("{}.{}", layer_prefix(layer), self.hf())
    }

    /// Full GGUF name in block `layer`.
    pub fn gguf_name(self, layer: usize) -> String {
        format!("{GGUF_BLOCKS}.{layer}.{}", self.gguf())
    }
}

/// The HF name of a GGUF tensor, if it is one [`crate::model::Policy`]
/// knows.
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    if let Some((hf, _)) = TOP.iter().find(|(_, g)| *g == name) {
        return Some(hf.to_string());
    }
    let rest = name.strip_prefix(GGUF_BLOCKS)?.strip_prefix('.')?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let t = LayerTensor::ALL.into_iter().find(|t| t.gguf() == suffix)?;
    Some(t.name(layer))
}

/// The GGUF name of a HF tensor name, if it has one.
pub fn hf_to_gguf_name(name: &str) -> Option<String> {
    if let Some((_, g)) = TOP.iter().find(|(h, _)| *h == name) {
        return Some(g.to_string());
    }
    let rest = name.strip_prefix(LAYERS)?.strip_prefix('.')?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let t = LayerTensor::ALL.into_iter().find(|t| t.hf() == suffix)?;
    Some(t.gguf_name(layer))
}
