//! tmem core
