"""CrossHair obligations over kvcore.spec and kvcore's pure functions; see test_proofs.py."""
