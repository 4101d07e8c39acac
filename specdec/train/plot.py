"""The loss curve of a training run (`<out>/loss.png`), shared by specdec train and specdec distill."""

from __future__ import annotations

from pathlib import Path

from specdec.models.weights import atomic_write


def plot_loss(history: list[dict], path: Path, loss_label: str, acc_label: str) -> None:
    """loss.png: history's "loss" per epoch and its "heldout_acc" on a second axis, one line per
    draft step where entries have "heldout_acc_by_step" (atomic write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    epochs = [h["epoch"] for h in history]
    ax.plot(epochs, [h["loss"] for h in history], marker="o", label="training loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel(loss_label)
    ax2 = ax.twinx()
    by_step = [h.get("heldout_acc_by_step") or [h["heldout_acc"]] for h in history]
    for j in range(min(map(len, by_step))):  # one line per draft step where the history has them
        ax2.plot(
            epochs,
            [a[j] for a in by_step],
            color=f"C{j + 1}",
            marker="s",
            label=acc_label if j == 0 else f"draft step {j + 1}",
        )
    ax2.set_ylabel("accuracy")
    fig.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
