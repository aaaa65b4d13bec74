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
    let m = args.model.options()?.load()?;
    let c = &m.config;
    println!("model        {}", m.path.display());
    println!("format       {}", m.format);
    println!("layers       {}", c.n_layers);
    println!("hidden       {}", c.hidden_size);
    println!("ffn          {}", c.intermediate_size);
    println!(
        "heads        {} (KV heads {}, head dim {})",
        c.n_heads, c.n_kv_heads, c.head_dim
    );
    println!("vocab        {}", c.vocab_size);
    println!("context      {}", c.context_length);
    println!("rope theta   {}", c.rope_theta);
    if let Some(s) = &c.rope_scaling {
        println!("rope scaling {s:?}");
    }
    println!("rms eps      {}", c.rms_norm_eps);
    println!("tied embed   {}", c.tie_word_embeddings);
    let types: Vec<String> = m
        .tensor_types()
        .iter()
        .map(|(t, n)| format!("{t} x{n}"))
        .collect();
    println!("matrices     {}", types.join(", "));
    let params = c.parameter_count();
    println!("parameters   {params} ({:.1}M)", params as f64 / 1e6);
    println!(
        "chat template {}",
        if m.chat_template.is_some() {
            "yes"
        } else {
            "no (ChatML fallback)"
        }
    );
    Ok(())
}
