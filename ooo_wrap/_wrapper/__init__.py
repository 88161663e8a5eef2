"""The wrapper: ``OOOModule``, its life from learning to unwrap, copies and pickles."""
