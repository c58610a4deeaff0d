"""App tests: the Flask app through its test client and the engine in this process, on the tiny dev model."""
