"""Tasks of the MONAI Label app: one-shot landmark suggestion (infer) and the bundle's training (train)."""
