"""Subprocess half of tests/test_sharding.py. JAX fixes the device count when it starts, so the 4-device checks run
here, in a fresh interpreter started with XLA_FLAGS=--xla_force_host_platform_device_count=4.

  python tests/sharding_worker.py compare NAME=PATH:DATA ...   {NAME: compare_sharded report + placements}
  python tests/sharding_worker.py generate PATH                 plain vs sharded generate streams
  python tests/sharding_worker.py spec PATH                     plain (one device) vs sharded speculative streams,
                                                                single-conversation and batched

Prints one JSON object on stdout.
"""

import json
import sys

import jax
import numpy as np

import fucina_jax
from fucina_jax import sharding

N_DEVICES = 4


def compare(args):
    out, models = {}, {}
    for arg in args:
        name, _, rest = arg.partition("=")
        path, _, data = rest.rpartition(":")
        if path not in models:  # one reference model per file: its compiled steps serve every mesh
            models[path] = fucina_jax.load(path, f32=True)
        model = models[path]
        mesh = sharding.make_mesh(N_DEVICES, data=int(data))
        sharded = sharding.shard_model(model, mesh)
        report = sharding.compare_sharded(model, sharded, batch=2)
        layer0 = sharded.params["layers"][0]
        report["placement"] = {k: str(layer0[k].sharding.spec) for k in ("attn_q", "attn_k", "attn_output",
                                                                         "ffn_gate", "ffn_down")}
        report["placement"]["token_embd"] = str(sharded.params["token_embd"].sharding.spec)
        # loading straight into shards gives the same arrays in the same places
        direct = sharding.load_sharded(path, mesh)
        pairs = zip(jax.tree_util.tree_leaves(direct.params), jax.tree_util.tree_leaves(sharded.params))
        report["load_sharded_equal"] = all(
            a.sharding == b.sharding and np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs
        )
        out[name] = report
    return out


def generate(path):
    model = fucina_jax.load(path, f32=True)
    sharded = sharding.shard_model(model, sharding.make_mesh(N_DEVICES))
    ids = [int(x) for x in np.random.default_rng(1).integers(0, 260, 9)]
    out = {}
    for name, kw in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.9, "seed": 5})):
        out[name] = [m.generate(ids, 16, **kw).run().tokens for m in (model, sharded)]
    return out


def spec(path):
    """Per sampler: the plain single-device streams of 4 prompts, and on each 4-device mesh (tensor parallel, and
    2 x 2 with the batch rows split over "data") the batched decoder's streams of all 4 in one batch, and on the
    tensor-parallel mesh the single decoder's, one conversation at a time; with the number of draft tokens each
    accepted (so the test knows speculation really ran)."""
    from fucina_jax.generate import generate
    from fucina_jax.sampling import SamplerConfig
    from fucina_jax.generate import generate_batched, generate_speculative
    from fucina_jax.speculative import SpecOptions

    model = fucina_jax.load(path, f32=True)
    rng = np.random.default_rng(2)
    phrase = [int(x) for x in rng.integers(0, 260, 5)]
    prompts = [phrase * 3, [int(x) for x in rng.integers(0, 260, 9)], phrase[:3] * 4 + [7], [11, 12, 13]]
    always = SpecOptions(policy="gate", min_speedup=0.0, adapt_budget=False, max_draft=7)
    kw = {"max_tokens": 20, "ctx": 64, "stop_ids": ()}
    samplers = {"greedy": SamplerConfig(temperature=0.0, top_k=20, seed=0),
                "sampled": SamplerConfig(temperature=0.9, top_k=20, repeat_penalty=1.1, seed=5)}
    out = {}
    for name, samp in samplers.items():
        r = out[name] = {"plain": [generate(model, p, sampler=samp, **kw).run().tokens for p in prompts]}
        for data in (1, 2):
            sharded = sharding.shard_model(model, sharding.make_mesh(N_DEVICES, data=data))
            batch = generate_batched(sharded, prompts, sampler=samp, options=always, **kw)
            r[f"batched_dp{data}"] = [x.tokens for x in batch]
            r[f"batched_dp{data}_accepted"] = sum(x.spec["accepted"] for x in batch)
            if data == 1:  # one conversation at a time: the single decoder (B = 1 has no rows to split over "data")
                single = [generate_speculative(sharded, p, sampler=samp, options=always, clock=False, **kw).run()
                          for p in prompts]
                r["single"] = [x.tokens for x in single]
                r["single_accepted"] = sum(x.spec["accepted"] for x in single)
    return out


if __name__ == "__main__":
    assert jax.device_count() == N_DEVICES, f"expected {N_DEVICES} forced host devices, got {jax.devices()}"
    mode, *rest = sys.argv[1:]
    run = {"compare": lambda: compare(rest), "generate": lambda: generate(rest[0]), "spec": lambda: spec(rest[0])}
    json.dump(run[mode](), sys.stdout)
