"""Helpers shared by several test modules (no tests here): import them as `support.<module>`."""
