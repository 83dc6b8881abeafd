"""Test and benchmark helpers (not shipped): namespaces for unit tests, the offline vLLM runner,
throwaway redis-servers."""
