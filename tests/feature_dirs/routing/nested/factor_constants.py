"""A plain helper module (no features) imported by its sibling `nested_feature.py` by bare name."""

NESTED_FACTOR = 7
