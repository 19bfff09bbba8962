"""Where the CPU time of oscar_torch/tests/test_hf.py::test_smollm2_generate_vs_jax_runtime_and_dynamic_cache
goes (SmolLM2-135M GGUF, float32, the shipped artifact, the test's 420-token Wikipedia prompt):

    TRITON_INTERPRET=1 JAX_PLATFORMS=cpu PYTHONPATH=. python -m benchmarks.probe_interpret_hf 4
    TRITON_INTERPRET=1 JAX_PLATFORMS=cpu PYTHONPATH=. python -m benchmarks.probe_interpret_hf 24 --half jax

`--half torch` (the default): a cProfile of transformers' generate through OscarHFCache (the
Triton interpreter's time by function, NOTES v22). `--half jax`: the test's JAX half timed by
phase — OscarRuntime's admit (the prefill, compiles included), its first step and the rest (NOTES v23).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time


def _prompt(model_name: str = "smollm2-135m", tokens: int = 420):
    from calibration.data import wiki_documents
    from oscar_jax.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    text = ""
    for doc in wiki_documents("evaluation"):  # the test's prompt
        text += doc + "\n\n"
        if len(tokenizer.encode(text)) >= tokens:
            break
    return tokenizer.encode(text)[:tokens]


def torch_half(ids, new_tokens: int) -> None:
    import torch
    import transformers

    import oscar_torch.hf  # noqa: F401 - registers the "oscar" attention
    from oscar_jax.generate import shipped_artifact
    from oscar_jax.loaders import resolve_model_path
    from oscar_torch.hf import OscarHFCache
    from shared_math.artifact import read_artifact

    path = resolve_model_path("smollm2-135m")
    artifact = read_artifact(shipped_artifact("smollm2-135m"))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="oscar").eval()
    cache = OscarHFCache.from_artifact(artifact, model.config, max_cache_len=512)
    profile = cProfile.Profile()
    t0 = time.time()
    profile.enable()
    model.generate(torch.tensor([ids]), past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
                   pad_token_id=0)
    profile.disable()
    print(f"generate: {time.time() - t0:.0f} s")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(45)


def jax_half(ids, new_tokens: int) -> None:
    import numpy as np

    from oscar_jax.generate import shipped_artifact
    from oscar_jax.loaders import load_model
    from oscar_jax.runtime import OscarRuntime
    from shared_math.artifact import read_artifact

    artifact = read_artifact(shipped_artifact("smollm2-135m"))
    cfg, params = load_model("smollm2-135m")
    rt = OscarRuntime(params, cfg, artifact, max_batch=1, max_seq_len=512)  # as the test
    t0 = time.time()
    sid, first, _ = rt.admit(np.asarray(ids))
    token = int(np.argmax(np.asarray(first)))
    admitted = time.time()
    steps = []
    for _ in range(new_tokens - 1):
        t = time.time()
        token = int(np.argmax(np.asarray(rt.step([sid], [token])[0])))
        steps.append(time.time() - t)
    print(f"admit ({len(ids)} tokens): {admitted - t0:.0f} s; first step {steps[0] if steps else 0:.0f} s; "
          f"{len(steps) - 1} more steps: {sum(steps[1:]):.0f} s ({np.median(steps[1:]) if len(steps) > 1 else 0:.2f} s "
          f"median); total {time.time() - t0:.0f} s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("new_tokens", type=int, nargs="?", default=4)
    parser.add_argument("--half", choices=("torch", "jax"), default="torch")
    args = parser.parse_args(argv)
    ids = _prompt()
    (torch_half if args.half == "torch" else jax_half)(ids, args.new_tokens)


if __name__ == "__main__":
    main()
