"""Arguments that the tests' short `titan-jax train` runs share."""

# No live bar and no loss.png (the plot's own tests draw it); the per-step lines still print
# and metrics.jsonl is written.
QUIET_METRICS = ("--metrics.progress_bar", "false", "--metrics.plot_loss", "false")
