"""bench/quality.py's pure parts: llama-perplexity's windows and scored positions, the statistics per
position, what llama-perplexity prints and writes; and corechat's side end to end on the tiny model."""

import math

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from bench.perplexity import BASE_MAGIC, BaseFile, base_perplexity, first_difference, parse_kl_divergence
from bench.quality import (
    Tally,
    agreed_tokens,
    corechat_side,
    read_text,
    render,
    scored_positions,
    text_tokens,
    windows_of,
)

# The end of what llama-perplexity (llama.cpp vendored by llama-cpp-python 0.3.36) printed for
# SmolLM2-135M-Instruct's q4_0 against its f32 base over the GPL-3, -c 512 -t 2: verbatim.
KL_DIVERGENCE_OUTPUT = """\
  14      23.0911 ±    1.0872       0.23258 ±    0.01335       0.28993 ±    0.00476    13.708 ±  0.341 %    69.104 ±  0.773 %

====== Perplexity statistics ======
Mean PPL(Q)                   :  23.091106 ±   1.087223
Mean PPL(base)                :  18.299381 ±   0.859447
Cor(ln(PPL(Q)), ln(PPL(base))):  95.97%
Mean ln(PPL(Q)/PPL(base))     :   0.232580 ±   0.013347
Mean PPL(Q)/PPL(base)         :   1.261852 ±   0.016843
Mean PPL(Q)-PPL(base)         :   4.791725 ±   0.356589

====== KL divergence statistics ======
Mean    KLD:   0.289930 ±   0.004758
Maximum KLD:   3.667037
99.9%   KLD:   2.451376
99.0%   KLD:   1.501637
95.0%   KLD:   0.782118
90.0%   KLD:   0.571137
Median  KLD:   0.220020
10.0%   KLD:   0.053614
 5.0%   KLD:   0.027649
 1.0%   KLD:   0.007286
 0.1%   KLD:   0.000885
Minimum KLD:   0.000110

====== Token probability statistics ======
Mean    Δp: -4.536 ± 0.217 %
Maximum Δp: 71.208%
99.9%   Δp: 52.963%
99.0%   Δp: 26.754%
Median  Δp: -0.501%
Minimum Δp: -88.217%
RMS Δp    : 13.708 ± 0.341 %
Same top p: 69.104 ± 0.773 %
"""  # noqa: E501 (verbatim)
# The f32 run's last lines, the same text and model (its -f and --kl-divergence-base run).
BASE_OUTPUT = """\
0.04.129.688 I perplexity: calculating perplexity over 14 chunks, n_ctx=512, batch_size=2048, n_seq=4
[1]16.2628,[2]17.6855,[3]16.2900,[4]18.1979,[5]18.2297,[6]18.0669,[7]18.0705,[8]18.3410,[9]18.2635,[10]18.5181,[11]18.3873,[12]18.4522,[13]17.6311,[14]18.2994,
1.23.013.166 I Final estimate: PPL = 18.2994 +/- 0.85945
"""  # noqa: E501 (verbatim)


def test_windows_are_every_whole_chunk_and_the_tail_is_dropped():
    """As llama-perplexity cuts them: consecutive, as many whole windows as fit, nothing changed without a BOS."""
    ids = list(range(1000, 3000))
    windows = windows_of(ids, 512, None)
    assert [window[0] for window in windows] == [1000, 1512, 2024]
    assert all(window == ids[512 * index:512 * (index + 1)] for index, window in enumerate(windows))


def test_where_the_vocabulary_adds_a_bos_it_replaces_each_windows_first_token():
    """llama-perplexity tokenizes with the BOS first, then overwrites every window's first token with it
    (so window 2 loses a text token rather than shifting)."""
    ids = [1, *range(1000, 2100)]
    windows = windows_of(ids, 512, 1)
    assert len(windows) == 2
    assert windows[0] == ids[:512]
    assert windows[1] == [1, *ids[513:1024]]


def test_a_text_shorter_than_two_windows_is_refused_as_llama_perplexity_refuses_it():
    """llama-perplexity needs 2 * n_ctx tokens; scoring fewer on one side only would compare different texts."""
    with pytest.raises(ValueError, match="at least 1024"):
        windows_of(list(range(1023)), 512, None)


def test_the_scored_positions_are_the_second_half_less_the_last():
    """Positions 256..510 of 512, each predicting the token after it (257..511): 255 per window."""
    positions = scored_positions(512)
    assert (positions.start, positions.stop - 1, len(positions)) == (256, 510, 255)


def word_tokenizer(template: str | None) -> PreTrainedTokenizerFast:
    """Return a real fast tokenizer of a few words, adding a BOS first where a template says so."""
    vocabulary = {"<s>": 0, "<unk>": 1, "the": 2, "text": 3}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    if template:
        tokenizer.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", unk_token="<unk>")


def test_the_text_is_tokenized_with_the_bos_only_where_the_tokenizer_adds_one():
    """A BOS is put first, and each window starts with it, exactly when the tokenizer adds one."""
    assert text_tokens(word_tokenizer(None), "the text") == ([2, 3], None)
    assert text_tokens(word_tokenizer("<s> $A"), "the text") == ([0, 2, 3], 0)
    with pytest.raises(ValueError, match="other than a first BOS"):
        text_tokens(word_tokenizer("$A <s>"), "the text")


def test_the_text_loses_one_final_newline_as_with_llama_perplexitys_file_option(tmp_path):
    """-f drops one trailing newline; a token more or less at the end could change the window count."""
    path = tmp_path / "text"
    path.write_text("a\n\n")
    assert read_text(path) == "a\n"


def base_file(path, window: int, tokens: list[int], log_probs: np.ndarray) -> BaseFile:
    """Write a base file as llama-perplexity writes one (log-probabilities quantized over 16 below the
    maximum) and map it."""
    windows, positions, vocabulary = log_probs.shape
    rows = np.zeros((windows, positions, 2 * ((vocabulary + 1) // 2) + 4), dtype="<u2")
    for index in np.ndindex(windows, positions):
        row = log_probs[index]
        minimum = max(row.min(), row.max() - 16)
        scale = (row.max() - minimum) / 65535
        rows[index][:4] = np.array([scale, minimum], dtype="<f4").view("<u2")
        if scale:  # a flat row keeps its levels at 0, as llama-perplexity writes it
            rows[index][4:4 + vocabulary] = np.rint((np.maximum(row, minimum) - minimum) / scale)
    header = np.array([window, vocabulary, windows], dtype="<i4").tobytes()
    path.write_bytes(BASE_MAGIC + header + np.asarray(tokens, dtype="<i4").tobytes() + rows.tobytes())
    return BaseFile.read(path)


def test_the_base_file_gives_the_scored_ids_and_log_probabilities_back(tmp_path):
    """Tokens and each scored position's log-probabilities, within the file's 16-bit steps."""
    generator = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(2, 3, 5, generator=generator) * 3, dim=-1).numpy()
    tokens = list(range(16))
    base = base_file(tmp_path / "base.dat", 8, tokens, log_probs)  # positions 4..6 of windows of 8
    assert (base.window, base.vocabulary, base.tokens.tolist()) == (8, 5, tokens)
    for index in range(2):
        assert np.allclose(base.log_probs(index), log_probs[index], atol=16 / 65535)
    targets = [torch.tensor([0, 4, 2]), torch.tensor([1, 1, 3])]
    nll = [-log_probs[index][np.arange(3), target.numpy()] for index, target in enumerate(targets)]
    assert base.perplexity(targets) == pytest.approx(math.exp(np.concatenate(nll).mean()), rel=1e-3)


def test_a_tokenizer_disagreeing_with_llama_cpp_is_found_and_llama_cpps_ids_and_bos_taken(tmp_path):
    """The first differing id is named (a missing window counts); llama.cpp's ids keep its BOS."""
    base = base_file(tmp_path / "base.dat", 4, [7, 10, 11, 12, 13, 14, 15, 16], np.zeros((2, 1, 3), np.float32))
    assert first_difference([7, 10, 11, 12, 13, 14, 15, 16, 17], base) is None
    assert first_difference([7, 10, 11, 12, 13, 99, 15, 16, 17], base) == 5
    assert first_difference([7, 10, 11, 12, 13, 14, 15], base) == 7
    assert first_difference([7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], base) == 8
    assert base.scored_ids(7) == ([7, 10, 11, 12, 13, 14, 15, 16], 7)
    assert base.scored_ids(1) == ([7, 10, 11, 12, 13, 14, 15, 16], None)


def test_where_the_tokenizers_differ_both_sides_score_llama_cpps_ids_and_the_table_says_so(tmp_path):
    """The same ids on both sides whatever happens: corechat's where they agree, else those llama-perplexity
    scored (its BOS kept), with where and how they differ."""
    tokenizer = word_tokenizer("<s> $A")
    base = base_file(tmp_path / "base.dat", 4, [0, 2, 3, 2, 0, 3, 3, 2], np.zeros((2, 1, 5), np.float32))
    same = [0, 2, 3, 2, 0, 3, 3, 2, 3]
    assert agreed_tokens(tokenizer, same, 0, base) == (same, 0, "identical on both sides (corechat's tokenizer "
                                                                "and llama-perplexity's base file)")
    ids, bos, found = agreed_tokens(tokenizer, [0, 2, 3, 3, 0, 3, 3, 2, 3], 0, base)
    assert (ids, bos) == ([0, 2, 3, 2, 0, 3, 3, 2], 0)
    assert "differs from llama.cpp's** from token 3 on (corechat ['text', '<s>', 'text'], llama.cpp ['the'" in found


def test_the_tally_gives_perplexity_kl_divergence_and_top1_per_position():
    """KL(P_ref || P) per position in nats, the perplexity of the targets, and top-1 agreement."""
    reference = torch.tensor([[0.5, 0.5, 0.0], [0.7, 0.2, 0.1]]).clamp_min(1e-30).log()
    other = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1]]).clamp_min(1e-30).log()
    tally = Tally()
    tally.add(reference, other, torch.tensor([0, 1]))
    scores = tally.scores(bits=8.5, reference_perplexity=2.0)
    first = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    second = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert scores.kld_mean == pytest.approx((first + second) / 2, rel=1e-6)
    assert scores.kld_max == pytest.approx(second, rel=1e-6)
    assert scores.perplexity == pytest.approx(math.exp(-(math.log(0.9) + math.log(0.7)) / 2), rel=1e-6)
    assert scores.perplexity_ratio == pytest.approx(scores.perplexity / 2.0)
    assert scores.top1_same == 0.5


def test_the_tally_leaves_reference_tokens_below_a_floor_out_as_llama_perplexity_does():
    """llama-perplexity sums the KL divergence over the base's tokens above e^-16 only."""
    reference = torch.tensor([[0.0, -20.0]])
    other = torch.tensor([[-1.0, -100.0]])
    floored, exact = Tally(), Tally()
    floored.add(reference, other, torch.tensor([0]), floor=-16.0)
    exact.add(reference, other, torch.tensor([0]))
    assert floored.kld[0][0] == pytest.approx(1.0)
    assert exact.kld[0][0] > floored.kld[0][0]


def test_llama_perplexitys_statistics_are_read_from_its_real_output():
    """Each figure as printed: perplexity, its ratio to the base's, KLD mean / median / 99% / max, same top."""
    scores = parse_kl_divergence(KL_DIVERGENCE_OUTPUT, 5.35)
    assert scores.bits_per_weight == 5.35
    assert (scores.perplexity, scores.perplexity_ratio) == (23.091106, 1.261852)
    assert (scores.kld_mean, scores.kld_median, scores.kld_99, scores.kld_max) == (0.289930, 0.220020, 1.501637,
                                                                                  3.667037)
    assert scores.top1_same == pytest.approx(0.69104)
    assert base_perplexity(BASE_OUTPUT) == 18.2994
    with pytest.raises(ValueError, match="Same top p"):
        parse_kl_divergence(KL_DIVERGENCE_OUTPUT.replace("Same top p", "Same top"), 5.35)


def test_corechats_side_scores_each_dtype_against_float32_on_the_tiny_model(tiny_model_dir):
    """float32 is the reference (ratio 1, no KLD); bfloat16 runs the lean forward close to it; the table shows both."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (256,), generator=generator).tolist()
    windows = windows_of(ids, 64, None)
    scores, runs, against_peer = corechat_side(tiny_model_dir, ["bfloat16"], windows, None)
    assert runs["float32"] == "float32, transformers forward" and runs["bfloat16"].endswith(", lean forward")
    assert against_peer is None
    assert scores["float32"].perplexity_ratio == 1.0 and scores["float32"].kld_mean is None
    assert 0 <= scores["bfloat16"].kld_mean < 0.01 and scores["bfloat16"].top1_same > 0.9
    assert scores["bfloat16"].bits_per_weight == 16.0
    record = {"model": "tiny", "corechat": {name: vars(figures) for name, figures in scores.items()},
              "llama.cpp": {}, "runs": runs, "token_ids": "corechat's tokenizer's",
              "text": {"file": "random", "tokens": 256, "window": 64, "windows": 4, "scored_positions": "32..62",
                       "scored_tokens": 124, "bos": "no BOS"}}
    table = render(record)
    assert "| corechat float32 | 32.00 |" in table and "| 1.0000 | — | — | — |" in table
    assert "| corechat bfloat16 | 16.00 |" in table
