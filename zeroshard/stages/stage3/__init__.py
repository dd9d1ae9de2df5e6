"""Stage 3: parameters partitioned by module unit and gathered on demand."""
