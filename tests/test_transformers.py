"""triflash under Hugging Face transformers (integrations.register_transformers), on tiny random-weight
models built from configs (no downloads): Llama (GQA), Mistral (sliding window), Gemma 2 (sliding and
full layers, logit soft-capping), gpt-oss (attention sinks, trained through triflash's dsink), where
the installed transformers has them.

Each model runs three ways from the same weights: with ``TRANSFORMERS_NAME`` (triflash), with
transformers' own same-dtype attention ("sdpa", or "eager" where the model refuses sdpa), and in
float64 with "eager" (the truth). The rules are the kernel suites': logits within 2x the same-dtype
attention's error (test_forward.py), gradients within 3x (test_backward.py); greedy generation gives
the same tokens. Batches are padded (left and right) so the varlen path runs, not only the dense one.
"""

import copy

import pytest
import torch
from helpers import FLOOR, assert_2x_rule, max_err, relative

transformers = pytest.importorskip(
    "transformers", reason="Hugging Face transformers is not installed (pip install 'triflash[hf]')")

from triflash import integrations  # noqa: E402
from triflash.integrations import TRANSFORMERS_NAME, register_transformers  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
SEQLEN = 12
WINDOW = 5                                      # < SEQLEN: the sliding window masks something


def _config(kind, **extra):
    """(config, name of transformers' own attention for it), or a skip when this transformers lacks it."""
    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "gemma2": "Gemma2Config",
               "gpt_oss": "GptOssConfig"}
    cls = getattr(transformers, classes[kind], None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {classes[kind]}")
    kwargs = dict(TINY)
    if kind == "mistral":
        kwargs.update(sliding_window=WINDOW)
    if kind == "gemma2":
        kwargs.update(sliding_window=WINDOW, query_pre_attn_scalar=8, attn_logit_softcapping=None,
                      final_logit_softcapping=None, layer_types=["sliding_attention", "full_attention"])
    if kind == "gpt_oss":
        kwargs.update(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                      layer_types=["sliding_attention", "full_attention"])
    kwargs.update(extra)
    return cls(**kwargs), ("sdpa" if kind in ("llama", "mistral") else "eager")


def _models(config, baseline):
    """The same random weights three ways: triflash (fp32), transformers' own (fp32), and SDPA in
    float64, the truth. (Not eager in float64: its mask holds float64's minimum, which its float32
    softmax turns into -inf, so a left-padded query that sees no key makes NaNs that spread. Gemma 2
    declines SDPA because of soft-capping; without soft-capping SDPA computes it exactly, so the truth
    is switched to it after construction.)"""
    register_transformers()
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=TRANSFORMERS_NAME)
    same = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=baseline)
    truth = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=baseline)
    for model in (same, truth):
        model.load_state_dict(ours.state_dict())
    truth.double()
    truth.config._attn_implementation = "sdpa"
    assert ours.config._attn_implementation == TRANSFORMERS_NAME
    return ours, same, truth


def _padded_batch(device):
    """Two rows of SEQLEN tokens: the first padded on the left (3), the second on the right (2)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, TINY["vocab_size"], (2, SEQLEN), generator=gen)
    mask = torch.ones(2, SEQLEN, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    ids = ids.masked_fill(mask == 0, TINY["pad_token_id"])
    return ids.to(device), mask.to(device)


def _logits_and_grads(model, ids, mask):
    """One training step's forward and backward (loss on the real tokens)."""
    model.train()
    model.zero_grad()
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def _check_step(ours, same, truth, device, batch=None):
    """Logits (real positions) by the 2x rule, every parameter's gradient by the 3x rule."""
    ids, mask = batch if batch is not None else _padded_batch(device)
    real = mask.bool()
    results = [_logits_and_grads(m.to(device), ids, mask) for m in (ours, same, truth)]
    (got, g_got), (base, g_base), (ref, g_ref) = results
    assert_2x_rule("logits", got[real], ref[real], base[real], torch.float32)
    assert g_got.keys() == g_ref.keys()
    floor = relative(FLOOR[torch.float32], torch.cat([g.flatten() for g in g_ref.values()]))
    for name in g_ref:
        err, err_base = max_err(g_got[name], g_ref[name]), max_err(g_base[name], g_ref[name])
        assert err <= 3 * err_base + floor, (
            f"grad of {name}: max error {err:.3e} > 3 x transformers' own {err_base:.3e} + floor {floor:.1e}")


def _check_generate(ours, same, device, new_tokens=4, **kwargs):
    """Greedy generation from a left-padded batch gives the same tokens as transformers' own attention."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    ids = ids.masked_fill(mask == 0, TINY["pad_token_id"]).to(device)
    mask = mask.to(device)
    tokens = []
    for model in (ours, same):
        model.to(device).eval()
        with torch.no_grad():
            tokens.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                         do_sample=False, pad_token_id=TINY["pad_token_id"], **kwargs))
    assert tokens[0].tolist() == tokens[1].tolist()


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_training_step_matches(device, kind):
    """Padded batch, one training step: every attention call on triflash (varlen), none in PyTorch."""
    counts = register_transformers()
    counts.reset()
    _check_step(*_models(*_config(kind)), device)
    assert counts["torch"] == 0, counts
    assert counts["triflash"] == TINY["num_hidden_layers"]


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma2"])
def test_greedy_generate_matches(device, kind):
    """Prefill of a left-padded batch, then decoding with a KV cache (Mistral's and Gemma 2's sliding
    layers keep only the window): the same tokens as transformers' own attention, all on triflash."""
    counts = register_transformers()
    counts.reset()
    ours, same, _ = _models(*_config(kind))
    _check_generate(ours, same, device)
    assert counts == {"triflash": 4 * TINY["num_hidden_layers"], "torch": 0, "reasons": {}}


def test_static_cache_generate_matches(device):
    """A static cache's keys include unused slots past the sequence: the mask marks them, and the
    queries stay aligned with the last real key."""
    counts = register_transformers()
    ours, same, _ = _models(*_config("llama"))
    counts.reset()
    _check_generate(ours, same, device, new_tokens=3, cache_implementation="static")
    assert counts == {"triflash": 3 * TINY["num_hidden_layers"], "torch": 0, "reasons": {}}


VARIANT_MODELS = [pytest.param("gemma2", id="gemma2-softcap"), pytest.param("gpt_oss", id="gpt_oss-sinks")]


@pytest.mark.parametrize("kind", VARIANT_MODELS)
def test_softcap_and_sinks_run_on_triflash(device, kind):
    """Gemma 2's logit soft-capping and gpt-oss's attention sinks (``s_aux``) run on triflash: one
    training step's logits by the 2x rule and every parameter's gradient (the sinks' included) by the
    3x rule, against float64 eager attention (SDPA has neither), every call on triflash. The batch
    is right-padded only: float64 eager's additive mask turns a row that sees no key (a left-padded
    query) into NaN."""
    extra = {"attn_logit_softcapping": 20.0} if kind == "gemma2" else {}
    counts = register_transformers()
    ours, same, truth = _models(*_config(kind, **extra))
    truth.config._attn_implementation = "eager"
    truth.config._experts_implementation = "eager"      # gpt-oss's grouped_mm experts take no float64
    ids, mask = _padded_batch(device)
    mask[0] = 1
    counts.reset()
    _check_step(ours, same, truth, device, batch=(ids, mask))
    assert counts == {"triflash": TINY["num_hidden_layers"], "torch": 0, "reasons": {}}


@pytest.mark.parametrize("kind", VARIANT_MODELS)
def test_softcap_and_sinks_generate(device, kind):
    """Greedy generation with soft-capping or sinks (prefill of a left-padded batch, then decoding
    with a KV cache) gives transformers' own tokens, all on triflash."""
    extra = {"attn_logit_softcapping": 20.0} if kind == "gemma2" else {}
    counts = register_transformers()
    counts.reset()
    ours, same, _ = _models(*_config(kind, **extra))
    _check_generate(ours, same, device)
    assert counts == {"triflash": 4 * TINY["num_hidden_layers"], "torch": 0, "reasons": {}}


def test_padding_with_gaps_runs_in_pytorch(device):
    """A padding mask that is neither left nor right padding (a hole) gets transformers' 4-D mask, and
    runs in PyTorch, counted."""
    counts = register_transformers()
    counts.reset()
    ours, same, truth = _models(*_config("llama"))
    ids, mask = _padded_batch(device)
    mask[1, 4] = 0
    real = mask.bool()
    with torch.no_grad():
        got, base, ref = (m.to(device).eval()(input_ids=ids, attention_mask=mask).logits for m in (ours, same, truth))
    assert_2x_rule("logits", got[real], ref[real], base[real], torch.float32)
    assert counts["reasons"] == {"padding with gaps": TINY["num_hidden_layers"]}


# -- the pieces, without a model ----------------------------------------------------------------------

def test_name_is_one_transformers_accepts():
    """transformers treats names containing "flash" as FlashAttention builds to import: the default
    name avoids that (and the other words it reads meaning into), and a custom one is checked."""
    for word in ("flash", "sdpa", "flex", "eager", "paged"):
        assert word not in TRANSFORMERS_NAME
    with pytest.raises(ValueError, match="'flash'"):
        register_transformers("triflash")
    assert register_transformers() is integrations.TRANSFORMERS_COUNTS
    assert TRANSFORMERS_NAME in transformers.AttentionInterface().valid_keys()


@pytest.mark.parametrize("rows,seqlen_q,expect_q,expect_k", [
    # keys per row (1 real, 0 padding); the queries are the last seqlen_q positions
    pytest.param(["0011111", "1111100"], 7, [0, 2, 7, 7, 7, 12, 14], [0, 2, 7, 7, 7, 12, 14], id="left-right"),
    pytest.param(["0011111", "1111111"], 1, [0, 0, 1, 1, 1, 2, 2], [0, 2, 7, 7, 7, 14, 14], id="decode"),
    pytest.param(["0000", "0110"], 2, [0, 0, 0, 2, 2, 3, 4], [0, 0, 0, 4, 5, 7, 8], id="empty-row"),
])
def test_padding_segments(rows, seqlen_q, expect_q, expect_k):
    keys = torch.tensor([[c == "1" for c in row] for row in rows])
    cu_q, cu_k, q_rows = integrations._padding_segments(keys, seqlen_q)
    # three sequences per row (padding before, the real tokens, padding after); repeats are empty ones
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    assert cu_q.tolist() == expect_q and cu_k.tolist() == expect_k
    assert torch.equal(q_rows, keys[:, keys.shape[1] - seqlen_q:])
    # the real queries of each row end where its real keys end (bottom-right alignment)
    for b in range(len(rows)):
        q_len, k_len = (cu[3 * b + 2] - cu[3 * b + 1] for cu in (cu_q, cu_k))
        assert q_len == q_rows[b].sum() and k_len == keys[b].sum()


def test_layers_share_the_padding_offsets(device, monkeypatch):
    """The layers of one forward pass get the same mask tensor: its offsets are derived once, and again
    for other queries or after the mask changed in place; each call equals the one computed afresh."""
    derived = []
    real = integrations._padding_segments
    monkeypatch.setattr(integrations, "_padding_segments", lambda *a: derived.append(1) or real(*a))
    keys = torch.tensor([[False, True, True, True], [True, True, True, False]], device=device)
    q, k, v = (torch.randn(2, 4, 2, 16, dtype=torch.float16, device=device) for _ in range(3))

    def fresh(q, k, v, keys):
        return integrations._padded(q, k, v, keys.clone(), None, True, (-1, -1))
    for _ in range(3):                                    # three layers
        assert torch.equal(integrations._padded(q, k, v, keys, None, True, (-1, -1)), fresh(q, k, v, keys))
    assert len(derived) == 1 + 3                          # once for the layers, once per fresh call
    q1 = q[:, -1:]
    assert torch.equal(integrations._padded(q1, k, v, keys, None, True, (-1, -1)), fresh(q1, k, v, keys))
    keys[0, 0] = True                                     # changed in place: new offsets
    assert torch.equal(integrations._padded(q, k, v, keys, None, True, (-1, -1)), fresh(q, k, v, keys))
    assert len(derived) == 4 + 2 + 2


def _queries(q_length, q_offset=0):
    """The queries' arguments of a mask builder call: q_length and q_offset (recent transformers), or
    their positions, cache_position (up to transformers 5.1 or so)."""
    import inspect

    from transformers import masking_utils as mu

    if "q_length" in inspect.signature(mu.sdpa_mask).parameters:
        return dict(q_length=q_length, q_offset=q_offset)
    return dict(cache_position=torch.arange(q_offset, q_offset + q_length))


def test_mask_builder_answers():
    """None without padding, the [B, keys] padding mask for left/right padding, transformers' 4-D mask
    (with its reason) for gaps and for patterns triflash does not compute."""
    from transformers import masking_utils as mu

    build = integrations._transformers_mask
    causal = dict(batch_size=2, kv_length=6, mask_function=mu.causal_mask_function, **_queries(6))
    assert build(**causal) is None
    assert build(**causal, attention_mask=torch.ones(2, 6, dtype=torch.bool)) is None
    left = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6], dtype=torch.bool)
    assert torch.equal(build(**causal, attention_mask=left), left)
    gaps = torch.tensor([[1, 0, 1, 1, 1, 1], [1] * 6], dtype=torch.bool)
    mask = build(**causal, attention_mask=gaps)
    assert mask.dim() == 4 and mask._triflash_reason == "padding with gaps"
    sliding = dict(causal, mask_function=mu.sliding_window_causal_mask_function(3), local_size=3)
    assert build(**sliding) is None
    other = dict(causal, mask_function=mu.sliding_window_causal_mask_function(2), local_size=3)
    assert build(**other)._triflash_reason == "mask pattern"
    chunked = dict(causal, mask_function=mu.and_masks(mu.causal_mask_function, lambda b, h, q, k: k >= 2))
    assert build(**chunked)._triflash_reason == "mask pattern"
    short = dict(causal, kv_length=4)                    # 6 queries, 4 keys in the layer's range
    assert build(**short)._triflash_reason == "queries past the keys"
    # a static cache: 10 slots, 6 tokens so far (decoding the 6th): the 4 unused slots are cut off
    static = dict(batch_size=2, kv_length=10, mask_function=mu.causal_mask_function, **_queries(1, 5))
    assert build(**static).shape == (2, 6)


def test_docs_recipe_runs(capsys):
    """docs/huggingface.md's Python blocks run as written, and its counts comment is what they print."""
    import pathlib
    import re

    page = pathlib.Path(__file__).resolve().parents[1] / "docs" / "huggingface.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks
    register_transformers().reset()
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/huggingface.md block {i}", "exec"), {"__name__": "docs"})
    assert "{'triflash': 6, 'torch': 0, 'reasons': {}}" in capsys.readouterr().out
