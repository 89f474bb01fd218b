//! The projector: folds every sub-cluster's event stream into compact cluster-wide
//! indexes (key hash to sub-clusters, roaring bitmaps, bloom filters).
