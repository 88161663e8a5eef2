"""Models, factories and helpers shared by the tests."""
