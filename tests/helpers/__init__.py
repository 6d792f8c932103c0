"""Test helpers: checkpoints, servers, references and fakes shared by the test rooms (never test modules)."""
