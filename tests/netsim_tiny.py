"""The smallest netsim VGS-ATD scenario worth running: three cohorts over digits, 8 px images,
one 16-wide block. Tests copy it (json round trip) before changing it."""

TINY = {
    "scenario": {"name": "tiny", "seed": 1, "methods": ["vgs-atd"], "step_deadline_s": 30},
    "model": {"img_size": 8, "patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2},
    "train": {"epochs": 1, "lr": 3e-3, "freeze_blocks": 0},
    "baselines": {"rounds": 2},
    "ensemble": {"pca_components": 8, "mlp_epochs": 30, "rf_trees": 20},  # 100 trees: 30% of a run
    "topology": {"degree": 2, "poll_interval_s": 0.2},
    "datasets": [{"name": "digits", "spec": "digits"}],
    "cohorts": [
        {"name": "a", "nodes": ["a1", "a2"], "dataset": "digits", "classes": ["0", "1", "2"],
         "partition": "label_skew", "alpha": 1.0, "train_samples": 120, "test_samples": 40},
        {"name": "b", "phase": 2, "nodes": ["b1"], "dataset": "digits", "classes": ["3", "4"],
         "train_samples": 60, "test_samples": 40},
        {"name": "c", "phase": 3, "group": "B", "nodes": ["c1", "c2"], "dataset": "digits",
         "classes": ["0", "1", "2", "3", "4"], "train_samples": 100, "test_samples": 40},
    ],
}
