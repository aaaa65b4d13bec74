//! `turbo info`: what a model file holds.

use crate::runtime::ModelArgs;
use anyhow::Result;
use clap::Args;

#[derive(Args)]
pub struct InfoArgs {
    #[command(flatten)]
    model: ModelArgs,
}

pub fn run(args: InfoArgs) -> Result<()> {
    let options = args.model.options()?;
    let m = options.load()?;
    let c = &m.config;
    outln!("model        {}", m.path.display())?;
    outln!("format       {}", m.format)?;
    outln!("layers       {}", c.n_layers)?;
    outln!("hidden       {}", c.hidden_size)?;
    outln!("ffn          {}", c.intermediate_size)?;
    outln!(
        "heads        {} (KV heads {}, head dim {})",
        c.n_heads,
        c.n_kv_heads,
        c.head_dim
    )?;
    outln!("vocab        {}", c.vocab_size)?;
    outln!("context      {}", c.context_length)?;
    outln!("rope theta   {}", c.rope_theta)?;
    if let Some(s) = &c.rope_scaling {
        outln!("rope scaling {s:?}")?;
    }
    outln!("rms eps      {}", c.rms_norm_eps)?;
    outln!("tied embed   {}", c.tie_word_embeddings)?;
    let types: Vec<String> = m
        .tensor_types()
        .iter()
        .map(|(t, n)| format!("{t} x{n}"))
        .collect();
    outln!("matrices     {}", types.join(", "))?;
    let params = c.parameter_count();
    outln!("parameters   {params} ({:.1}M)", params as f64 / 1e6)?;
    // The KV cache's bytes per token for the dtype asked for (scales included), against bf16.
    let kv_row =
        |dtype: turbo_core::KvDtype| c.n_layers * 2 * c.n_kv_heads * dtype.row_bytes(c.head_dim, 2);
    let dtype = options.kv_dtype;
    outln!(
        "kv cache     {dtype}: {} bytes a token{}",
        kv_row(dtype),
        if dtype.is_quantized() {
            format!(
                " with its scales ({:.0}% of bf16's {})",
                100.0 * kv_row(dtype) as f64 / kv_row(turbo_core::KvDtype::Full) as f64,
                kv_row(turbo_core::KvDtype::Full)
            )
        } else {
            " (f32 on the CPU: twice that)".to_string()
        }
    )?;
    let world = options.tensor_parallel;
    if world > 1 {
        let plan = turbo_llama::ShardPlan::new(c, world)?;
        let kv = if plan.kv_replicas > 1 {
            format!("1 KV head held by {} ranks", plan.kv_replicas)
        } else {
            format!("{} KV heads", plan.kv_heads_per_rank)
        };
        let gb = |rank| plan.bytes_of_rank(c, &m.weights, rank) as f64 / 1e9;
        let (least, most) = (0..world)
            .map(gb)
            .fold((f64::MAX, 0f64), |(lo, hi), g| (lo.min(g), hi.max(g)));
        let weights = match (most - least) * 1e3 < 1.0 {
            true => format!("{most:.3} GB of weights per rank"),
            false => format!("{least:.3}-{most:.3} GB of weights per rank"),
        };
        let (fewest, most) = (plan.vocab(c, 0).len(), plan.vocab(c, world - 1).len());
        let vocab = match fewest == most {
            true => format!("{most}"),
            false => format!("{fewest}-{most}"),
        };
        outln!(
            "tensor par.  {world} ranks: {} heads, {kv}, FFN {} and {vocab} of the {}-token vocabulary per rank; {weights} (rank 0 gathers the logits)",
            plan.heads_per_rank,
            plan.ffn_per_rank,
            c.vocab_size,
        )?;
    }
    outln!(
        "chat template {}",
        if m.chat_template.is_some() {
            "yes"
        } else {
            "no (ChatML fallback)"
        }
    )?;
    Ok(())
}
