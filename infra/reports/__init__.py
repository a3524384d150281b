"""What operators read about a running environment: cost and hygiene."""
