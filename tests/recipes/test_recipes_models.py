"""The recipe networks: sizes from the papers, shapes, decoding."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_dgc_recipes.language import WordLanguageModel
from lightning_dgc_recipes.resnet import CIFARResNet, build_resnet
from lightning_dgc_recipes.speech import (
    CHARACTERS,
    DeepSpeech,
    LibriSpeechDataModule,
    SpeechRecognizer,
    encode_transcript,
    greedy_decode,
)
from lightning_dgc_recipes.vision import ImageClassifier


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    ("arch", "count"),
    [
        ("resnet20", 269_722),
        ("resnet32", 464_154),
        ("resnet44", 658_586),
        ("resnet56", 853_018),
        ("resnet110", 1_727_962),
    ],
)
def test_cifar_resnets_have_the_published_sizes(arch: str, count: int) -> None:
    # option-A shortcuts are parameter-free: 0.27 M ... 1.7 M parameters (He et al. 2016, Table 6)
    assert parameters(build_resnet(arch, 10)) == count


def test_option_b_adds_projection_shortcuts() -> None:
    a, b = build_resnet("resnet20", 10, "A"), build_resnet("resnet20", 10, "B")
    assert parameters(b) - parameters(a) == (16 * 32 + 2 * 32) + (32 * 64 + 2 * 64)
    assert b(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet50_matches_the_reference_size() -> None:
    network = build_resnet("resnet50", 1000)
    assert parameters(network) == 25_557_032  # torchvision's resnet50
    assert network(torch.randn(1, 3, 64, 64)).shape == (1, 1000)


def test_cifar_resnet_rejects_depths_outside_6n_plus_2() -> None:
    with pytest.raises(ValueError, match="6n\\+2"):
        CIFARResNet(depth=21)
    with pytest.raises(ValueError, match="Unknown architecture"):
        ImageClassifier(arch="resnet18")


def test_image_classifier_schedule_warms_up_then_steps() -> None:
    model = ImageClassifier("resnet8", base_width=4, lr=0.4, milestones=(4, 6), warmup_epochs=3)
    config = model.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(8):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.04, 0.04, 0.004, 0.004])


def test_language_model_ties_weights_and_checks_sizes() -> None:
    model = WordLanguageModel(vocab_size=50, embedding_dim=8, hidden_size=8)
    assert model.decoder.weight is model.embedding.weight
    logits, (h, c) = model(torch.randint(0, 50, (3, 5)))
    assert logits.shape == (3, 5, 50) and h.shape == c.shape == (2, 3, 8)
    with pytest.raises(ValueError, match="tie_weights"):
        WordLanguageModel(vocab_size=50, embedding_dim=8, hidden_size=16)
    untied = WordLanguageModel(vocab_size=50, embedding_dim=8, hidden_size=16, tie_weights=False)
    assert untied.decoder.weight is not untied.embedding.weight


def test_language_model_carries_state_between_windows_only_when_asked() -> None:
    torch.manual_seed(0)
    batch = (torch.randint(0, 20, (2, 4)), torch.randint(0, 20, (2, 4)))
    for carry in (True, False):
        model = WordLanguageModel(
            vocab_size=20, embedding_dim=8, hidden_size=8, dropout=0.0, carry_hidden=carry
        ).eval()
        first, second = model._step(batch, "val")[1], model._step(batch, "val")[1]
        assert torch.equal(first, second) is not carry
        model.on_validation_epoch_start()  # a new pass over the data starts from a zero state
        assert torch.equal(model._step(batch, "val")[1], first)


def test_deepspeech_halves_time_and_outputs_characters() -> None:
    model = DeepSpeech(n_mels=40, conv_channels=4, rnn_hidden=16, rnn_layers=2).eval()
    log_probs, lengths = model(torch.randn(3, 40, 51), torch.tensor([51, 40, 7]))
    assert log_probs.shape == (3, 26, len(CHARACTERS)) and lengths.tolist() == [26, 20, 4]
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(3, 26))
    # the padding of a batch does not change a shorter utterance's output
    short = torch.randn(1, 40, 7)
    alone, _ = model(short, torch.tensor([7]))
    batch = torch.cat([short, torch.zeros(1, 40, 44)], dim=2).expand(3, 40, 51).clone()
    together, _ = model(batch, torch.tensor([7, 51, 51]))
    torch.testing.assert_close(together[0, :4], alone[0])


def test_deepspeech_paper_size_is_reachable() -> None:
    model = DeepSpeech(n_mels=80, conv_channels=32, rnn_hidden=1200, rnn_layers=7)
    assert len(model.rnns) == 7 and model.rnns[-1].rnn.hidden_size == 1200 and model.rnns[0].rnn.bidirectional


def test_speech_recognizer_checks_feature_size(librispeech_root: Path) -> None:
    data = LibriSpeechDataModule(str(librispeech_root), "train-fake", "dev-fake", num_workers=0, n_mels=16)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False)
    with pytest.raises(ValueError, match="model.n_mels=40 but data.n_mels=16"):
        trainer.fit(SpeechRecognizer(n_mels=40), datamodule=data)


def test_greedy_decoding_merges_repeats_and_drops_blanks() -> None:
    letters = encode_transcript("hi no").tolist()  # lower case is upper-cased
    h, i, space, n, o = letters
    path = [0, h, h, 0, i, space, space, n, 0, n, o, o, 0, 0]  # "HI NNO" once repeats merge across a blank
    log_probs = torch.nn.functional.one_hot(torch.tensor([path]), len(CHARACTERS)).float().log()
    assert greedy_decode(log_probs, torch.tensor([len(path)])) == ["HI NNO"]
    assert greedy_decode(log_probs, torch.tensor([5])) == ["HI"]
