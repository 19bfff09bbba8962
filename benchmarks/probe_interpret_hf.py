"""cProfile of the torch half of oscar_torch/tests/test_hf.py::test_smollm2_generate_vs_jax_runtime_and_dynamic_cache
(SmolLM2-135M GGUF, float32, the shipped artifact, a 420-token Wikipedia prompt, OscarHFCache): the
Triton interpreter's time by function (NOTES v22).

    TRITON_INTERPRET=1 JAX_PLATFORMS=cpu PYTHONPATH=. python -m benchmarks.probe_interpret_hf 4
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    new_tokens = int(argv[0]) if argv else 4

    import torch
    import transformers

    import oscar_torch.hf  # noqa: F401 - registers the "oscar" attention
    from calibration.data import wiki_documents
    from oscar_jax.generate import shipped_artifact
    from oscar_jax.loaders import resolve_model_path
    from oscar_jax.tokenizer import load_tokenizer
    from oscar_torch.hf import OscarHFCache
    from shared_math.artifact import read_artifact

    path = resolve_model_path("smollm2-135m")
    artifact = read_artifact(shipped_artifact("smollm2-135m"))
    tokenizer = load_tokenizer("smollm2-135m")
    text = ""
    for doc in wiki_documents("evaluation"):  # the test's prompt
        text += doc + "\n\n"
        if len(tokenizer.encode(text)) >= 420:
            break
    ids = tokenizer.encode(text)[:420]
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


if __name__ == "__main__":
    main()
