"""Subprocess half of tests/test_sharding.py. JAX fixes the device count when it starts, so the 4-device checks run
here, in a fresh interpreter started with XLA_FLAGS=--xla_force_host_platform_device_count=4.

  python tests/sharding_worker.py compare NAME=PATH:DATA ...   {NAME: compare_sharded report + placements}
  python tests/sharding_worker.py generate PATH                 plain vs sharded generate streams

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
            models[path] = fucina_jax.load(path)
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
    model = fucina_jax.load(path)
    sharded = sharding.shard_model(model, sharding.make_mesh(N_DEVICES))
    ids = [int(x) for x in np.random.default_rng(1).integers(0, 260, 9)]
    out = {}
    for name, kw in (("greedy", {"temperature": 0.0}), ("sampled", {"temperature": 0.9, "seed": 5})):
        out[name] = [m.generate(ids, 16, **kw).run().tokens for m in (model, sharded)]
    return out


if __name__ == "__main__":
    assert jax.device_count() == N_DEVICES, f"expected {N_DEVICES} forced host devices, got {jax.devices()}"
    mode, *rest = sys.argv[1:]
    json.dump(compare(rest) if mode == "compare" else generate(rest[0]), sys.stdout)
