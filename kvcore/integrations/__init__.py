"""Adapters that plug kvcore into inference engines.

Each adapter is a subpackage that imports its engine; nothing else in kvcore imports an
adapter, so kvcore itself never needs an engine installed.
"""
