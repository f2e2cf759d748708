"""The static tier: files and offline validators only (tests/README.md). This conftest puts the
tier's folder on `sys.path` for its subfolders, so `source_tree` and `deploy_support` import by
plain name from any of them."""
