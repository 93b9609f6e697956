"""Vision-language models through DTAEngine against the per-sequence dense oracle (each sequence alone, unpadded,
through the stock model with its own images), on a GRPO-shaped batch with images (`vision_models.image_batch`: two
groups showing the same image, one showing another image after the same text, a text-only sequence, a prompt with
two images).

- float64, the towers' float32 rotation removed on both sides (`vision_models.exact_vision_rope`) and the RMSNorms in
  float64: log-probs, entropies, the loss and every parameter gradient (vision tower and projector included) within
  1e-10, for Qwen2-VL and Qwen2.5-VL, packed rows and the walk with recompute; the no-grad call too.
- LoRA on every linear layer, the tower's included (PEFT's `all-linear`): the adapters' gradients, float64, 1e-10.
- The image keys: equal images share their tokens, different ones do not; TRL's batch layout read per row.
- Refusals: images for a model without a vision tower or of a refused family (Gemma 3), an image among the scored
  tokens, the lockstep walk.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import make_model, use_input_dtype_norms
from reference import compare_grads, compare_lists, dense_forward_backward, grads_of
from test_engine import nonlinear_loss
from trl_dta import DTAEngine, PrefixTree
from trl_dta.refusal import DTAUnsupportedError
from trl_dta.vision import ImageInputs, batch_images, key_images, row_images
from vision_models import IMAGE, VLM_FAMILIES, VOCAB, dense_inputs, exact_vision_rope, image, image_batch, make_vlm

TOL = 1e-10
SEQS, IMAGES = image_batch()
N_SCORED = [2 + i % 3 for i in range(len(SEQS))]  # completions of 2-4 tokens (the prompts are never scored)
# Engine settings: the default (the whole tree in one packed row), and the depth-first walk with recompute in blocks
# shorter than the image runs and leaves batched two by two.
SCHEDULES = {"packed": {}, "walk": dict(max_pack_tokens=0, max_graph_tokens=0, block_size=3, max_batch_tokens=16)}


@pytest.fixture(scope="module", params=list(VLM_FAMILIES))
def exact_vlm(request):
    """A float64 tiny VLM with float64 norms, and its oracle: per-sequence log-probs, entropies, gradients."""
    model = use_input_dtype_norms(make_vlm(request.param))
    inputs = [dense_inputs(s, im) for s, im in zip(SEQS, IMAGES)]
    with exact_vision_rope():
        _, lps, ents = dense_forward_backward(model, SEQS, nonlinear_loss, n_scored=N_SCORED, inputs=inputs)
    want = grads_of(model)
    model.zero_grad()
    return model, lps, ents, want


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_float64_exact(exact_vlm, schedule):
    model, want_lps, want_ents, want_grads = exact_vlm
    engine = DTAEngine(model, **SCHEDULES[schedule])
    with exact_vision_rope():
        model.zero_grad()
        out = engine.forward_backward(SEQS, nonlinear_loss, entropy=True, n_scored=N_SCORED, images=IMAGES)
        got = grads_of(model)
        scored = engine.logprobs(SEQS, entropy=True, n_scored=N_SCORED, images=IMAGES)
    for name, (got_list, want_list) in {"logps": (out.logps, want_lps), "entropies": (out.entropies, want_ents),
                                        "no-grad logps": (scored.logps, want_lps)}.items():
        err, where = compare_lists(got_list, want_list)
        assert err <= TOL, f"{name}: {err:.3g} at sequence {where}"
    err, name = compare_grads(got, want_grads)
    assert err <= TOL, f"gradients: {err:.3g} at {name}"
    tower = [n for n in want_grads if ".visual." in n]
    assert tower and all(n in got for n in tower), "the vision tower received no gradient"
    assert sum(float(want_grads[n].abs().sum()) for n in tower) > 0
    # The tower ran once per distinct image (2), not once per image shown (11); the tree counts image tokens.
    stats = out.stats
    assert (stats["images"], stats["image_rows"], stats["image_tokens"]) == (2, 11, 4 + 6)
    assert stats["tokens"] == sum(len(s) for s in SEQS)
    assert stats["compression_ratio"] == stats["tokens"] / stats["tree_tokens"] > 2


def test_lora_on_the_tower_float64_exact():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(use_input_dtype_norms(make_vlm("qwen2_vl")), config)
    inputs = [dense_inputs(s, im) for s, im in zip(SEQS, IMAGES)]
    with exact_vision_rope():
        _, want_lps, _ = dense_forward_backward(model, SEQS, nonlinear_loss, n_scored=N_SCORED, inputs=inputs)
        want = grads_of(model)
        model.zero_grad()
        out = DTAEngine(model).forward_backward(SEQS, nonlinear_loss, entropy=True, n_scored=N_SCORED, images=IMAGES)
    got = grads_of(model)
    assert any(".visual." in n and "lora_" in n for n in want), "no adapter on the vision tower"
    assert all("lora_" in n for n in got)  # the base stays frozen
    err, where = compare_lists(out.logps, want_lps)
    assert err <= TOL, f"logps: {err:.3g} at sequence {where}"
    err, name = compare_grads(got, want)
    assert err <= TOL, f"gradients: {err:.3g} at {name}"


def test_image_keys():
    """Equal images get equal keys (their tokens are shared), different images and images at other places do not;
    a placeholder count that does not match the images is refused, as the model refuses it."""
    keyed, table = key_images(SEQS, IMAGES, image_token_id=IMAGE, vocab_size=VOCAB, merge_size=2)
    assert (table.n_images, table.n_tokens, table.image_rows) == (2, 10, 11)
    assert torch.equal(keyed[0][:12], keyed[7][:12])  # group 0 (image A) and group 2 (A again): shared
    assert not torch.equal(keyed[0][4:8], keyed[3][4:8])  # image A vs image B after the same text
    assert all(int(k.max()) < VOCAB + table.n_tokens for k in keyed) and not any((k == IMAGE).any() for k in keyed)
    tree = PrefixTree.from_sequences(keyed)
    assert tree.n_tree_tokens > PrefixTree.from_sequences(SEQS).n_tree_tokens  # A and B no longer merged
    with pytest.raises(ValueError, match="image tokens"):
        key_images([SEQS[0][:-3]], [IMAGES[3]], image_token_id=IMAGE, vocab_size=VOCAB, merge_size=2)


def test_row_images_of_trl_batches():
    """TRL 1.16's batch layout (all rows' patches and grids concatenated, `num_images` per row; or one tensor per row
    after `split_pixel_values_by_grid`) read back per row; another vision input leaves the batch to the dense path."""
    g = torch.Generator().manual_seed(0)
    a, b = image(4, 4, g), image(2, 4, g)
    batch = {"prompt_ids": torch.zeros(3, 2), "num_images": [1, 0, 1],
             "pixel_values": torch.cat([a.pixel_values, b.pixel_values]), "image_grid_thw": torch.cat([a.grid_thw,
                                                                                                      b.grid_thw])}
    rows = row_images(batch)
    assert rows[1] is None and torch.equal(rows[0].pixel_values, a.pixel_values)
    assert torch.equal(rows[2].grid_thw, b.grid_thw)
    split = {**batch, "pixel_values": [a.pixel_values, b.pixel_values[:0], b.pixel_values],
             "image_grid_thw": [a.grid_thw, b.grid_thw[:0], b.grid_thw]}
    assert all((x is None) == (y is None) for x, y in zip(row_images(split), rows))
    assert row_images({"prompt_ids": torch.zeros(1, 2)}) == []
    assert row_images({**batch, "image_sizes": torch.ones(2, 2)}) is None
    # What the trainers hand the engine: the rows' images, or None (TRL's dense path) for images DTA cannot key.
    keys = dict(image_token_id=IMAGE, vocab_size=VOCAB, merge_size=2)
    seqs = [torch.tensor([1] + [IMAGE] * 4 + [7, 8]), torch.tensor([1, 7, 8]), torch.tensor([1, IMAGE, IMAGE, 9])]
    got = batch_images(seqs, [2, 2, 1], batch, keys)
    assert got[1] is None and torch.equal(got[0].pixel_values, a.pixel_values) and torch.equal(got[2].grid_thw,
                                                                                                b.grid_thw)
    assert batch_images(seqs, [2, 2, 3], batch, keys) is None  # an image among a completion's tokens
    assert batch_images(seqs, [2, 2, 1], batch, None) is None  # images for a model whose images DTA does not run
    assert batch_images(seqs, [2, 2, 1], {"prompt_ids": batch["prompt_ids"]}, None) == [None] * 3


def test_refusals():
    model = make_vlm("qwen2_vl", torch.float32)
    engine = DTAEngine(model)
    with pytest.raises(DTAUnsupportedError, match="image tokens among its last"):
        engine.logprobs(SEQS[:1], n_scored=[len(SEQS[0]) - 4], images=IMAGES[:1])
    with pytest.raises(DTAUnsupportedError, match="lockstep"):
        engine.logprobs(SEQS[:1], n_scored=[2], images=IMAGES[:1], lockstep=lambda n: n)
    with pytest.raises(DTAUnsupportedError, match="no vision tower"):
        DTAEngine(make_model("qwen2", torch.float32)).logprobs(SEQS[:1], images=IMAGES[:1])
    gemma = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                           image_size=8, patch_size=4), mm_tokens_per_image=4, image_token_id=IMAGE))
    with pytest.raises(DTAUnsupportedError, match="bidirectionally"):
        DTAEngine(gemma).logprobs([torch.tensor([1, 5, IMAGE, 7])], images=[ImageInputs(torch.zeros(4, 12),
                                                                                         torch.tensor([[1, 2, 2]]))])
