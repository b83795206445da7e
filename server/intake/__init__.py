"""What an update stream may say, and where its bytes go."""
