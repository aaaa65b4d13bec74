"""Writes a ShareGPT-like synthetic workload for `turbo generate --prompts-file`.

Prompt and output lengths are drawn from log-normal distributions (sigma 0.8, like the long-tailed
lengths of ShareGPT conversations) scaled to the requested means and clipped to [4, 4 * mean];
prompts are random common English words (about one token each in LLaMA-style BPE vocabularies).
Fixed seed, so every run of a benchmark uses the same requests.

    python3 benches/sharegpt_like.py OUT.jsonl --requests 1000 --mean-in 200 --mean-out 180 --seed 0
    python3 benches/sharegpt_like.py OUT.jsonl --requests 64 --fixed-in 128 --fixed-out 128
"""
import argparse, json, math, random

WORDS = ("the of and to in is was for on that with as by at from his her it an are were which be this "
         "had not but they have one all their there been has when who will more no if out so said what up "
         "its about into than them can only other new some could time these two may then do first any my now "
         "such like our over man me even most made after also did many before must through back years where "
         "much your way well down should because each just those people how too little state good very make "
         "world still own see men work long get here between both life being under never day same another know "
         "while last might us great old year off come since against go came right used take three").split()

def lengths(rng, n, mean, sigma=0.8):
    mu = math.log(mean) - sigma * sigma / 2
    return [max(4, min(4 * mean, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--mean-in", type=int, default=200)
    ap.add_argument("--mean-out", type=int, default=180)
    ap.add_argument("--fixed-in", type=int)
    ap.add_argument("--fixed-out", type=int)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    ins = [a.fixed_in] * a.requests if a.fixed_in else lengths(rng, a.requests, a.mean_in)
    outs = [a.fixed_out] * a.requests if a.fixed_out else lengths(rng, a.requests, a.mean_out)
    with open(a.out, "w") as f:
        for n_in, n_out in zip(ins, outs):
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
            f.write(json.dumps({"prompt": prompt, "max_tokens": n_out}) + "\n")
    print(f"{a.requests} requests, mean prompt {sum(ins) / len(ins):.0f} words, mean output {sum(outs) / len(outs):.0f} tokens")

if __name__ == "__main__":
    main()
