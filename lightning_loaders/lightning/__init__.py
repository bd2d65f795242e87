"""Lightning glue: the data module that carries cursors, the stall monitor, and the batch
indices Lightning's prediction writer reads."""
