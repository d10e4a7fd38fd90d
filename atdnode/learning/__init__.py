"""Learning on a node: the ViT, training, evaluation, features, classify and predict."""
