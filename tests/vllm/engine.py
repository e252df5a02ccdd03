"""Run vLLM (CPU) once on a model directory and print what the test compares, as JSON on the last line:
greedy tokens for fixed prompts. Usage (in the vLLM venv, tests/vllm/hook on PYTHONPATH):
    python engine.py MODEL_DIR auto|sharded_state TP
With CKPTCONV_VLLM_DUMP set, a normal load also dumps each rank's parameters (hook/sitecustomize.py)."""
import json
import os
import sys

PROMPTS = [[1, 17, 29, 301, 44, 5, 260, 91], [3, 480, 12, 7, 7, 150, 33, 2]]

if __name__ == "__main__":
    model, load_format, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    kwargs = {}
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
        kwargs["distributed_executor_backend"] = "mp"
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, load_format=load_format, tensor_parallel_size=tp, skip_tokenizer_init=True,
              enforce_eager=True, dtype="bfloat16", max_model_len=128, seed=0, **kwargs)
    if os.environ.get("CKPTCONV_VLLM_DUMP") and load_format == "auto":
        import sitecustomize
        llm.collective_rpc(sitecustomize.dump_state)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, detokenize=False), use_tqdm=False)
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs]}))
    sys.stdout.flush()
    os._exit(0)   # do not wait on vLLM's own teardown; its worker processes end with this one
