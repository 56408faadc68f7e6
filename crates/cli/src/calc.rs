//! `mooncake calc`: KV-cache bytes per token, per block and for N tokens, for a model of
//! the catalog (`models.json`, data built into the binary) or a Hugging Face
//! `config.json`, and how many blocks and tokens fit in a pool.
//!
//! The formulas are the KV Cache Size Calculator's as the `kvcache-simulator` package
//! computes them (same field defaults, same float operations in the same order, so the
//! bytes per token agree exactly): per attention family, elements per token times the
//! precision's bytes per element, with an indexer cache at its own precision where the
//! model has one, draft (MTP) layers when asked for, sliding windows and compressed
//! layers capped by the token count. The per-sequence state of linear-attention layers
//! is reported apart: it does not grow with tokens, and a block holds none of it.

use std::fmt::Write as _;

use super::args::Args;
use mooncake_base::json::{self, Value};

/// The catalog: models and precisions, as data.
const CATALOG: &str = include_str!("models.json");

/// 2^30.
const GIB: f64 = 1_073_741_824.0;

/// A precision option.
#[derive(Clone, Debug)]
pub struct Precision {
    /// Its id (`bf16_fp16`, ...).
    pub id: String,
    /// How people write it.
    pub label: String,
    /// Bytes per stored element.
    pub bytes: f64,
    aliases: Vec<String>,
}

impl Precision {
    fn matches(&self, name: &str) -> bool {
        let n = name
            .trim()
            .to_ascii_lowercase()
            .replace(['-', '/', ' '], "_");
        self.id == n || self.aliases.contains(&n)
    }
}

/// One model: its attention formula and the config fields it reads.
#[derive(Clone, Debug)]
pub struct Model {
    /// Catalog id.
    pub id: String,
    /// Display name.
    pub label: String,
    /// Formula name (see [`size`]).
    pub formula: String,
    /// Tokens the model is sized for when none are given.
    pub default_tokens: u64,
    fields: Vec<(String, Value)>,
}

/// Models and precisions.
pub struct Catalog {
    /// KV precisions.
    pub precisions: Vec<Precision>,
    /// Indexer-cache precisions.
    pub indexer_precisions: Vec<Precision>,
    /// Linear-attention recurrent-state precisions.
    pub recurrent_precisions: Vec<Precision>,
    /// The models.
    pub models: Vec<Model>,
}

fn precisions(v: &Value, key: &str) -> Result<Vec<Precision>, String> {
    let list = v
        .get(key)
        .and_then(Value::as_array)
        .ok_or(format!("catalog: `{key}` is missing"))?;
    list.iter()
        .map(|p| {
            Ok(Precision {
                id: p.str_field("id").map_err(|e| e.to_string())?.to_owned(),
                label: p.str_field("label").map_err(|e| e.to_string())?.to_owned(),
                bytes: p
                    .get("bytes_per_element")
                    .and_then(Value::as_f64)
                    .ok_or("catalog: a precision lacks bytes_per_element")?,
                aliases: p
                    .get("aliases")
                    .and_then(Value::as_array)
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|a| a.as_str().map(str::to_owned))
                    .collect(),
            })
        })
        .collect()
}

fn model_of(m: &Value) -> Result<Model, String> {
    let id = m.str_field("id").map_err(|e| e.to_string())?.to_owned();
    let fields = m
        .get("fields")
        .and_then(Value::as_object)
        .ok_or(format!("catalog: model {id} has no fields"))?
        .to_vec();
    Ok(Model {
        label: m
            .get("label")
            .and_then(Value::as_str)
            .unwrap_or(&id)
            .to_owned(),
        formula: m
            .str_field("formula")
            .map_err(|e| e.to_string())?
            .to_owned(),
        default_tokens: m
            .get("default_tokens")
            .and_then(Value::as_u64)
            .unwrap_or(4096),
        fields,
        id,
    })
}

impl Catalog {
    /// The built-in catalog.
    pub fn builtin() -> Result<Catalog, String> {
        Catalog::parse(CATALOG)
    }

    /// A catalog from its JSON text.
    pub fn parse(text: &str) -> Result<Catalog, String> {
        let v = json::parse(text).map_err(|e| format!("catalog: {e}"))?;
        let models = v
            .get("models")
            .and_then(Value::as_array)
            .ok_or("catalog: `models` is missing")?
            .iter()
            .map(model_of)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Catalog {
            precisions: precisions(&v, "precisions")?,
            indexer_precisions: precisions(&v, "indexer_precisions")?,
            recurrent_precisions: precisions(&v, "recurrent_state_precisions")?,
            models,
        })
    }

    /// The model `id`, or an error listing what there is.
    pub fn model(&self, id: &str) -> Result<&Model, String> {
        self.models.iter().find(|m| m.id == id).ok_or_else(|| {
            let ids: Vec<&str> = self.models.iter().map(|m| m.id.as_str()).collect();
            format!(
                "unknown model {id:?}; the catalog has: {} (or give --config PATH)",
                ids.join(", ")
            )
        })
    }
}

fn find<'a>(list: &'a [Precision], name: &str, what: &str) -> Result<&'a Precision, String> {
    list.iter().find(|p| p.matches(name)).ok_or_else(|| {
        let ids: Vec<&str> = list.iter().map(|p| p.id.as_str()).collect();
        format!("unknown {what} {name:?} (one of: {})", ids.join(", "))
    })
}

// ---------------------------------------------------------------------------
// Fields, read as the package reads them
// ---------------------------------------------------------------------------

impl Model {
    fn raw(&self, name: &str) -> Option<&Value> {
        self.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v)
    }

    /// A number as Python's `float()` reads it (booleans are 0 and 1).
    fn number(v: &Value) -> Option<f64> {
        match v {
            Value::Bool(b) => Some(f64::from(u8::from(*b))),
            Value::String(s) => s.trim().parse::<f64>().ok(),
            other => other.as_f64(),
        }
        .filter(|f| f.is_finite())
    }

    /// A field that must be there.
    fn field(&self, name: &str) -> Result<f64, String> {
        self.raw(name)
            .and_then(Model::number)
            .ok_or_else(|| format!("model {} is missing numeric field {name}", self.id))
    }

    /// A field with a default.
    fn opt(&self, name: &str, fallback: f64) -> f64 {
        match self.raw(name) {
            Some(v) => Model::number(v).unwrap_or(fallback),
            None => fallback,
        }
    }

    fn text(&self, name: &str) -> Option<&str> {
        self.raw(name).and_then(Value::as_str)
    }

    fn flag(&self, name: &str) -> bool {
        matches!(self.raw(name), Some(Value::Bool(true)))
    }

    fn has_indexer(&self) -> bool {
        self.raw("index_head_dim").and_then(Model::number).is_some()
    }

    fn ratios(&self) -> Vec<f64> {
        self.raw("compress_ratios")
            .and_then(Value::as_array)
            .unwrap_or_default()
            .iter()
            .filter_map(Model::number)
            .collect()
    }

    /// Draft (MTP) layers the model defines.
    fn draft_layers(&self) -> u64 {
        if self.flag("disable_draft_kv_cache") {
            return 0;
        }
        let nextn = self.opt("num_nextn_predict_layers", 0.0) as i64;
        if nextn > 0 {
            return nextn as u64;
        }
        if self.flag("use_mtp") {
            let n = self.opt("num_mtp_modules", 0.0) * self.opt("mtp_transformer_layers", 0.0);
            return n.max(0.0) as u64;
        }
        0
    }

    /// Whether the model has draft layers whose KV cache can be counted.
    pub fn has_draft(&self) -> bool {
        if self.formula == "deepseek_v4_hybrid" {
            let layers = self.opt("num_hidden_layers", 0.0) as usize;
            return self.ratios().len() > layers;
        }
        self.draft_layers() > 0
    }

    fn has_linear_state(&self) -> bool {
        matches!(
            self.formula.as_str(),
            "qwen_linear_full_hybrid" | "kimi_kda_mla_hybrid"
        )
    }
}

// ---------------------------------------------------------------------------
// The formulas
// ---------------------------------------------------------------------------

/// What is asked beyond the model: precisions (ids or aliases; `None` takes the
/// model's default) and whether draft layers count.
#[derive(Clone, Debug, Default)]
pub struct Ask {
    /// KV precision.
    pub precision: Option<String>,
    /// Indexer-cache precision (models with an indexer; a model may fix it).
    pub indexer_precision: Option<String>,
    /// Count the draft (MTP) layers' KV cache.
    pub draft: bool,
}

/// The KV cache of one sequence of `tokens` tokens.
#[derive(Clone, Debug)]
pub struct Size {
    /// Tokens the size is for.
    pub tokens: u64,
    /// KV precision id.
    pub precision: String,
    /// Indexer precision id, for models with an indexer cache.
    pub indexer_precision: Option<String>,
    /// Whether draft layers are counted (asked for and defined by the model).
    pub draft: bool,
    /// `total_bytes / tokens`.
    pub bytes_per_token: f64,
    /// Attention KV bytes.
    pub kv_bytes: f64,
    /// Indexer-cache bytes.
    pub indexer_bytes: f64,
    /// Everything that grows with the tokens.
    pub total_bytes: f64,
    /// Linear-attention state per sequence (not in the totals), with its precision.
    pub state_bytes_per_sequence: Option<(f64, String)>,
}

/// Role of a group of elements: which precision it is stored in.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Kv,
    Indexer,
}

/// Elements per group (in the package's order), for `tokens` tokens; `draft` counts
/// the draft layers (`draft_layers` of them, where the formula counts layers).
fn groups(
    m: &Model,
    tokens: f64,
    draft: bool,
    draft_layers: u64,
) -> Result<Vec<(Role, f64)>, String> {
    let t = tokens;
    let d = if draft { draft_layers as f64 } else { 0.0 };
    Ok(match m.formula.as_str() {
        "standard_gqa" => {
            let layers = m.field("num_hidden_layers")?.trunc() + d;
            let per_token = layers * 2.0 * m.field("num_key_value_heads")? * m.field("head_dim")?;
            vec![(Role::Kv, per_token * t)]
        }
        "mla" => {
            let layers = m.field("num_hidden_layers")?.trunc() + d;
            let per_token = layers * (m.field("kv_lora_rank")? + m.field("qk_rope_head_dim")?);
            vec![(Role::Kv, per_token * t)]
        }
        "dsa_mla" => {
            let layers = m.field("num_hidden_layers")?.trunc();
            let active = layers + d;
            let main = m.opt("indexer_full_layers", layers).trunc();
            let draft_indexer = if d > 0.0 {
                m.opt("draft_indexer_layers", d).trunc()
            } else {
                0.0
            };
            let kv = active * (m.field("kv_lora_rank")? + m.field("qk_rope_head_dim")?);
            let indexer = (main + draft_indexer) * m.field("index_head_dim")?;
            vec![(Role::Kv, kv * t), (Role::Indexer, indexer * t)]
        }
        "qwen_linear_full_hybrid" => {
            let per_token = m.field("full_attention_layers")?
                * 2.0
                * m.field("num_key_value_heads")?
                * m.field("head_dim")?;
            vec![(Role::Kv, per_token * t)]
        }
        "kimi_kda_mla_hybrid" => {
            let per_token = m.field("full_attention_layers")?
                * (m.field("kv_lora_rank")? + m.field("qk_rope_head_dim")?);
            vec![(Role::Kv, per_token * t)]
        }
        "mixed_full_sliding_gqa" => {
            let full_layers = m.field("full_attention_layers")?;
            let sliding_layers = m.field("sliding_attention_layers")?;
            let kv_heads = m.field("num_key_value_heads")?;
            let head_dim = m.field("head_dim")?;
            let full_heads = m.opt("num_global_key_value_heads", kv_heads);
            let full_dim = m.opt("global_head_dim", head_dim);
            let full_v = m.opt("global_v_head_dim", m.opt("v_head_dim", full_dim));
            let swa_heads = m.opt(
                "swa_num_key_value_heads",
                m.opt("sliding_num_key_value_heads", kv_heads),
            );
            let swa_dim = m.opt("swa_head_dim", m.opt("sliding_head_dim", head_dim));
            let swa_v = m.opt(
                "swa_v_head_dim",
                m.opt("sliding_v_head_dim", m.opt("v_head_dim", swa_dim)),
            );
            let retained = t.min(m.field("sliding_window")?.trunc());
            let full = t * full_layers * full_heads * (full_dim + full_v);
            let sliding = retained * sliding_layers * swa_heads * (swa_dim + swa_v);
            vec![(Role::Kv, full), (Role::Kv, sliding)]
        }
        "minimax_msa" => {
            let kv = m.field("num_hidden_layers")?
                * 2.0
                * m.field("num_key_value_heads")?
                * m.field("head_dim")?;
            let indexer = m.field("sparse_attention_layers")? * m.field("index_head_dim")?;
            vec![(Role::Kv, kv * t), (Role::Indexer, indexer * t)]
        }
        "deepseek_v4_hybrid" => {
            let head_dim = m.field("head_dim")?;
            let index_dim = m.field("index_head_dim")?;
            let window = m.field("sliding_window")?;
            let layers = m.field("num_hidden_layers")?.trunc().max(0.0) as usize;
            let ratios = m.ratios();
            let active = if draft {
                &ratios[..]
            } else {
                &ratios[..layers.min(ratios.len())]
            };
            if active.is_empty() {
                return Err(format!("model {} is missing compress_ratios", m.id));
            }
            let (mut windowed, mut compressed, mut indexer) = (0.0, 0.0, 0.0);
            for &ratio in active {
                windowed += window * head_dim;
                if ratio > 0.0 {
                    compressed += (t / ratio).floor() * head_dim;
                }
                if ratio == 4.0 {
                    indexer += (t / 4.0).floor() * index_dim;
                }
            }
            vec![(Role::Kv, windowed + compressed), (Role::Indexer, indexer)]
        }
        other => return Err(format!("model {}: unsupported formula {other:?}", m.id)),
    })
}

/// Linear-attention state bytes per sequence, at `recurrent` bytes per recurrent
/// element.
fn linear_state(m: &Model, recurrent: f64) -> Result<f64, String> {
    Ok(match m.formula.as_str() {
        "qwen_linear_full_hybrid" => {
            let layers = m.field("linear_attention_layers")?;
            let kernel = m.field("linear_conv_kernel_dim")?;
            let key_heads = m.field("linear_num_key_heads")?;
            let key_dim = m.field("linear_key_head_dim")?;
            let value_heads = m.field("linear_num_value_heads")?;
            let value_dim = m.field("linear_value_head_dim")?;
            // kernel - 1 past inputs, as the calculator counts.
            let conv =
                layers * (kernel - 1.0) * (2.0 * key_heads * key_dim + value_heads * value_dim);
            let rec = layers * value_heads * key_dim * value_dim;
            conv * 2.0 + rec * recurrent
        }
        "kimi_kda_mla_hybrid" => {
            let layers = m.field("kda_layers")?;
            let heads = m.field("kda_num_heads")?;
            let head_dim = m.field("kda_head_dim")?;
            let key_heads = m.opt("kda_num_key_heads", heads);
            let key_dim = m.opt("kda_key_head_dim", head_dim);
            let value_heads = m.opt("kda_num_value_heads", heads);
            let value_dim = m.opt("kda_value_head_dim", head_dim);
            let kernel = m.field("kda_conv_kernel_size")?;
            let conv_bytes = m.opt("kda_conv_state_bytes_per_element", 2.0);
            let conv = layers
                * (kernel - 1.0)
                * (heads * head_dim + key_heads * key_dim + value_heads * value_dim);
            let rec = layers * value_heads * value_dim * key_dim;
            conv * conv_bytes + rec * recurrent
        }
        _ => return Ok(0.0),
    })
}

/// The KV cache of `m` for one sequence of `tokens` tokens (0: the model's default).
pub fn size(cat: &Catalog, m: &Model, tokens: u64, ask: &Ask) -> Result<Size, String> {
    let precision = match &ask.precision {
        Some(p) => find(&cat.precisions, p, "precision")?,
        None => {
            let default = match m.text("default_precision_id") {
                Some(id) if cat.precisions.iter().any(|p| p.id == id) => id,
                _ if m.formula == "deepseek_v4_hybrid" => "fp8_int8",
                _ => "bf16_fp16",
            };
            find(&cat.precisions, default, "precision")?
        }
    };
    let indexer = if m.has_indexer() {
        let fixed = m
            .text("indexer_fixed_precision_id")
            .filter(|id| cat.indexer_precisions.iter().any(|p| p.id == *id));
        Some(match (fixed, &ask.indexer_precision) {
            (Some(id), _) => find(&cat.indexer_precisions, id, "indexer precision")?,
            (None, Some(p)) => find(&cat.indexer_precisions, p, "indexer precision")?,
            (None, None) if m.formula == "deepseek_v4_hybrid" => {
                find(&cat.indexer_precisions, "fp4_int4", "indexer precision")?
            }
            (None, None) => find(&cat.indexer_precisions, &precision.id, "indexer precision")
                .or_else(|_| find(&cat.indexer_precisions, "bf16_fp16", "indexer precision"))?,
        })
    } else {
        None
    };
    let draft = ask.draft && m.has_draft();
    let tokens = if tokens == 0 {
        m.default_tokens.max(1)
    } else {
        tokens
    };
    let (mut kv, mut idx, mut total) = (0.0, 0.0, 0.0);
    for (role, elements) in groups(m, tokens as f64, draft, m.draft_layers())? {
        let per = match (role, indexer) {
            (Role::Indexer, Some(p)) => p.bytes,
            _ => precision.bytes,
        };
        let bytes = elements * per;
        total += bytes;
        match role {
            Role::Indexer => idx += bytes,
            Role::Kv => kv += bytes,
        }
    }
    let state = if m.has_linear_state() {
        let default = match m.text("default_recurrent_state_precision_id") {
            Some(id) => id.to_owned(),
            None if m.opt("kda_recurrent_state_bytes_per_element", 0.0) == 2.0 => {
                "bf16_fp16".into()
            }
            None => "fp32".into(),
        };
        let p = find(&cat.recurrent_precisions, &default, "state precision")
            .or_else(|_| find(&cat.recurrent_precisions, "fp32", "state precision"))?;
        Some((linear_state(m, p.bytes)?, p.id.clone()))
    } else {
        None
    };
    Ok(Size {
        tokens,
        precision: precision.id.clone(),
        indexer_precision: indexer.map(|p| p.id.clone()),
        draft,
        bytes_per_token: total / tokens as f64,
        kv_bytes: kv,
        indexer_bytes: idx,
        total_bytes: total,
        state_bytes_per_sequence: state,
    })
}

// ---------------------------------------------------------------------------
// Hugging Face config.json
// ---------------------------------------------------------------------------

/// A model from a Hugging Face `config.json`: the family is told by its fields (an
/// MLA latent rank, an indexer, per-layer attention types), the rest is read as is.
pub fn model_from_config(text: &str, name: &str) -> Result<Model, String> {
    let root = json::parse(text).map_err(|e| format!("{name}: {e}"))?;
    // Multimodal configs nest the language model's.
    let c = match root.get("text_config") {
        Some(t) if t.get("num_hidden_layers").is_some() => t,
        _ => &root,
    };
    let num = |k: &str| c.get(k).and_then(Model::number);
    let need = |k: &str| num(k).ok_or_else(|| format!("{name}: no numeric `{k}`"));
    let mut fields: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, v: f64| fields.push((k.to_owned(), Value::from(v)));
    let layers = need("num_hidden_layers")?;
    put("num_hidden_layers", layers);
    let heads = num("num_attention_heads");
    let kv_heads = num("num_key_value_heads").or(heads);
    let head_dim = num("head_dim").or_else(|| Some(num("hidden_size")? / heads?));
    for k in ["num_nextn_predict_layers", "qk_rope_head_dim"] {
        if let Some(v) = num(k) {
            put(k, v);
        }
    }
    let layer_types: Vec<&str> = c
        .get("layer_types")
        .and_then(Value::as_array)
        .unwrap_or_default()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let count = |t: &str| layer_types.iter().filter(|x| x.contains(t)).count() as f64;
    let formula = if let Some(rank) = num("kv_lora_rank") {
        put("kv_lora_rank", rank);
        put("qk_rope_head_dim", num("qk_rope_head_dim").unwrap_or(0.0));
        match num("index_head_dim") {
            Some(d) => {
                put("index_head_dim", d);
                "dsa_mla"
            }
            None => "mla",
        }
    } else {
        put(
            "num_key_value_heads",
            kv_heads.ok_or(format!("{name}: no attention heads"))?,
        );
        put(
            "head_dim",
            head_dim.ok_or(format!("{name}: no head_dim or hidden_size"))?,
        );
        if count("linear") > 0.0 || num("full_attention_interval").is_some() {
            let full = if layer_types.is_empty() {
                (layers / need("full_attention_interval")?).floor()
            } else {
                count("full")
            };
            put("full_attention_layers", full);
            put("linear_attention_layers", layers - full);
            for k in [
                "linear_num_key_heads",
                "linear_key_head_dim",
                "linear_num_value_heads",
                "linear_value_head_dim",
                "linear_conv_kernel_dim",
            ] {
                put(k, need(k)?);
            }
            "qwen_linear_full_hybrid"
        } else if count("sliding") > 0.0 && c.get("use_sliding_window") != Some(&Value::Bool(false))
        {
            put("full_attention_layers", count("full"));
            put("sliding_attention_layers", count("sliding"));
            put("sliding_window", need("sliding_window")?);
            for k in [
                "global_head_dim",
                "num_global_key_value_heads",
                "v_head_dim",
            ] {
                if let Some(v) = num(k) {
                    put(k, v);
                }
            }
            "mixed_full_sliding_gqa"
        } else {
            "standard_gqa"
        }
    };
    let id = root
        .get("_name_or_path")
        .and_then(Value::as_str)
        .unwrap_or(name)
        .to_owned();
    Ok(Model {
        label: id.clone(),
        id,
        formula: formula.to_owned(),
        default_tokens: 1024,
        fields,
    })
}

// ---------------------------------------------------------------------------
// The command
// ---------------------------------------------------------------------------

fn gib(bytes: f64) -> f64 {
    bytes / GIB
}

pub use mooncake_base::util::size::human;

/// Reads `--model`/`--config`, `--precision`, `--indexer-precision` and `--draft`.
pub fn model_flags(a: &Args, cat: &Catalog) -> Result<Option<(Model, Ask)>, String> {
    let ask = Ask {
        precision: a.str("precision").map(str::to_owned),
        indexer_precision: a.str("indexer-precision").map(str::to_owned),
        draft: a.flag("draft")?,
    };
    let model = match (a.str("model"), a.str("config")) {
        (Some(_), Some(_)) => return Err("give --model or --config, not both".into()),
        (Some(id), None) => cat.model(id)?.clone(),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
            model_from_config(&text, path)?
        }
        (None, None) => {
            if ask.precision.is_some() || ask.indexer_precision.is_some() || ask.draft {
                return Err(
                    "--precision, --indexer-precision and --draft need --model or --config".into(),
                );
            }
            return Ok(None);
        }
    };
    Ok(Some((model, ask)))
}

/// `--list --json`: one line per model, precision, indexer precision asked (models
/// with an indexer) and draft setting (models with draft layers), at `tokens` tokens
/// (0: each model's default) -- the whole catalog in one run, for checks against the
/// package.
fn every_size(cat: &Catalog, tokens: u64) -> Result<Vec<Value>, String> {
    let mut rows = Vec::new();
    for m in &cat.models {
        let indexers: Vec<Option<String>> = if m.has_indexer() {
            std::iter::once(None)
                .chain(cat.indexer_precisions.iter().map(|p| Some(p.id.clone())))
                .collect()
        } else {
            vec![None]
        };
        let drafts: &[bool] = if m.has_draft() {
            &[false, true]
        } else {
            &[false]
        };
        for p in &cat.precisions {
            for ip in &indexers {
                for &draft in drafts {
                    let ask = Ask {
                        precision: Some(p.id.clone()),
                        indexer_precision: ip.clone(),
                        draft,
                    };
                    let s = size(cat, m, tokens, &ask)?;
                    rows.push(Value::object([
                        ("model", Value::from(m.id.as_str())),
                        ("precision", p.id.as_str().into()),
                        (
                            "indexer_precision_asked",
                            ip.as_deref().map_or(Value::Null, Value::from),
                        ),
                        ("draft", draft.into()),
                        ("tokens", s.tokens.into()),
                        ("bytes_per_token", s.bytes_per_token.into()),
                        ("total_bytes", s.total_bytes.into()),
                        (
                            "state_bytes_per_sequence",
                            s.state_bytes_per_sequence
                                .as_ref()
                                .map_or(Value::Null, |(b, _)| Value::from(*b)),
                        ),
                    ]));
                }
            }
        }
    }
    Ok(rows)
}

/// `mooncake calc`.
pub fn calc(raw: &[String]) -> Result<(), String> {
    let a = Args::parse(raw)?;
    let cat = Catalog::builtin()?;
    let list = a.flag("list")?;
    let json_out = a.flag("json")?;
    let chosen = model_flags(&a, &cat)?;
    let tokens: u64 = a.get("tokens", 0)?;
    let block_tokens: u64 = a.get("block-tokens", super::trace::DEFAULT_BLOCK_TOKENS)?;
    let pool = match a.str("pool-size") {
        None => None,
        Some(s) => {
            Some(mooncake_base::util::size::parse(s).map_err(|e| format!("--pool-size: {e}"))?)
        }
    };
    a.finish()?;
    if list {
        if chosen.is_some() || pool.is_some() {
            return Err("--list takes no model or pool (it lists the catalog)".into());
        }
        if json_out {
            for row in every_size(&cat, tokens)? {
                println!("{row}");
            }
        } else {
            for m in &cat.models {
                println!("{:<28} {:<26} {}", m.id, m.formula, m.label);
            }
        }
        return Ok(());
    }
    let (model, ask) =
        chosen.ok_or("give --model ID (see `mooncake calc --list`) or --config PATH")?;
    if block_tokens == 0 {
        return Err("--block-tokens must be positive".into());
    }
    let s = size(&cat, &model, tokens, &ask)?;
    let per_block = s.bytes_per_token * block_tokens as f64;
    let fit = pool.map(|p| {
        let blocks = if per_block > 0.0 {
            (p as f64 / per_block).floor()
        } else {
            0.0
        };
        (p, blocks as u64, blocks as u64 * block_tokens)
    });
    if json_out {
        let mut v = vec![
            ("model", Value::from(model.id.as_str())),
            ("formula", model.formula.as_str().into()),
            ("precision", s.precision.as_str().into()),
            (
                "indexer_precision",
                s.indexer_precision
                    .as_deref()
                    .map_or(Value::Null, Value::from),
            ),
            ("draft", s.draft.into()),
            ("tokens", s.tokens.into()),
            ("block_tokens", block_tokens.into()),
            ("bytes_per_token", s.bytes_per_token.into()),
            ("bytes_per_block", per_block.into()),
            ("kv_bytes", s.kv_bytes.into()),
            ("indexer_bytes", s.indexer_bytes.into()),
            ("total_bytes", s.total_bytes.into()),
            ("total_gib", gib(s.total_bytes).into()),
        ];
        if let Some((bytes, p)) = &s.state_bytes_per_sequence {
            v.push(("state_bytes_per_sequence", (*bytes).into()));
            v.push(("state_precision", p.as_str().into()));
        }
        if let Some((p, blocks, toks)) = fit {
            v.push(("pool_bytes", p.into()));
            v.push(("blocks_fit", blocks.into()));
            v.push(("tokens_fit", toks.into()));
        }
        println!("{}", Value::object(v));
        return Ok(());
    }
    let mut out = String::new();
    let _ = writeln!(out, "{} ({}, {})", model.label, model.id, model.formula);
    let label = |list: &[Precision], id: &str| {
        list.iter()
            .find(|p| p.id == id)
            .map_or(id.to_owned(), |p| p.label.clone())
    };
    let mut prec = format!("precision {}", label(&cat.precisions, &s.precision));
    if let Some(p) = &s.indexer_precision {
        prec += &format!(", indexer {}", label(&cat.indexer_precisions, p));
    }
    if s.draft {
        prec += ", draft layers counted";
    }
    let _ = writeln!(out, "  {prec}");
    let _ = writeln!(
        out,
        "  per token  {} ({} bytes)",
        human(s.bytes_per_token),
        s.bytes_per_token
    );
    let _ = writeln!(
        out,
        "  per block  {} ({block_tokens} tokens)",
        human(per_block)
    );
    let split = match s.indexer_precision {
        Some(_) => format!(
            " (KV {}, indexer {})",
            human(s.kv_bytes),
            human(s.indexer_bytes)
        ),
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "  {} tokens: {}{split}",
        s.tokens,
        human(s.total_bytes)
    );
    if let Some((bytes, p)) = &s.state_bytes_per_sequence {
        let _ = writeln!(
            out,
            "  linear-attention state {} per sequence ({p}; not in the totals)",
            human(*bytes)
        );
    }
    if let Some((p, blocks, toks)) = fit {
        let _ = writeln!(
            out,
            "  a {} pool holds {blocks} blocks = {toks} tokens",
            human(p as f64)
        );
    }
    print!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bpt(id: &str, precision: &str, tokens: u64) -> f64 {
        let cat = Catalog::builtin().unwrap();
        let ask = Ask {
            precision: Some(precision.into()),
            ..Ask::default()
        };
        size(&cat, cat.model(id).unwrap(), tokens, &ask)
            .unwrap()
            .bytes_per_token
    }

    #[test]
    fn the_catalog_loads_and_every_model_computes() {
        let cat = Catalog::builtin().unwrap();
        assert!(cat.models.len() >= 50);
        for m in &cat.models {
            for p in &cat.precisions {
                for draft in [false, true] {
                    let ask = Ask {
                        precision: Some(p.id.clone()),
                        draft,
                        ..Ask::default()
                    };
                    let s = size(&cat, m, 4096, &ask).unwrap();
                    assert!(s.bytes_per_token > 0.0, "{} {}", m.id, p.id);
                }
            }
        }
    }

    #[test]
    fn known_sizes() {
        // Llama 3.1 8B: 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 128 KiB per token.
        assert_eq!(bpt("llama-3.1-8b", "bf16", 1000), 131_072.0);
        assert_eq!(bpt("llama-3.1-8b", "fp8", 1000), 65_536.0);
        assert_eq!(bpt("llama-3.1-8b", "int4", 1000), 32_768.0);
        // DeepSeek V3: MLA, 61 layers x (512 + 64) latent elements.
        assert_eq!(bpt("deepseek-v3", "bf16_fp16", 1), 61.0 * 576.0 * 2.0);
        // A sliding window stops growing: bytes per token fall with the tokens.
        assert!(bpt("gemma-4-31b", "bf16", 100_000) < bpt("gemma-4-31b", "bf16", 1000));
    }

    #[test]
    fn precision_names_and_errors() {
        let cat = Catalog::builtin().unwrap();
        assert_eq!(find(&cat.precisions, "BF16", "p").unwrap().id, "bf16_fp16");
        assert_eq!(
            find(&cat.precisions, "fp8/int8", "p").unwrap().id,
            "fp8_int8"
        );
        assert!(find(&cat.precisions, "fp3", "p").is_err());
        assert!(cat.model("nope").unwrap_err().contains("llama-3.1-8b"));
    }

    #[test]
    fn hugging_face_configs_tell_their_family() {
        let gqa = r#"{"num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "hidden_size": 4096}"#;
        let m = model_from_config(gqa, "c").unwrap();
        assert_eq!(m.formula, "standard_gqa");
        let cat = Catalog::builtin().unwrap();
        let s = size(&cat, &m, 10, &Ask::default()).unwrap();
        assert_eq!(s.bytes_per_token, 131_072.0);
        let mla = r#"{"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "num_attention_heads": 128}"#;
        assert_eq!(model_from_config(mla, "c").unwrap().formula, "mla");
        let mixed = r#"{"text_config": {"num_hidden_layers": 4, "num_attention_heads": 8,
            "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
            "full_attention"]}}"#;
        let m = model_from_config(mixed, "c").unwrap();
        assert_eq!(m.formula, "mixed_full_sliding_gqa");
        // 32 tokens: the full layer keeps 32, the three sliding ones 16 each.
        let s = size(&cat, &m, 32, &Ask::default()).unwrap();
        assert_eq!(s.total_bytes, (32.0 + 3.0 * 16.0) * 2.0 * 64.0 * 2.0 * 2.0);
        assert!(model_from_config("{}", "c").is_err());
    }
}
