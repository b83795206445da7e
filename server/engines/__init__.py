"""What reads the store from outside: the local socket and the engine drivers."""
